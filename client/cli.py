"""`llmserve` command line: generate, stream, abort, inspect and resume requests; benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

from client.bench.cli import add_bench_parser, run_bench
from client.envs import address as default_address
from client.errors import run_guarded
from client.features import add_sampling_flags, sampling_fields
from client.health import add_health_parser
from client.outputs import AbortOutcome, RequestOutput, StreamDelta
from client.params import SamplingParams
from client.prompts import ChatPrompt
from client.sync_client import LLMClient


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=list(args.stop or []),
        stop_token_ids=list(args.stop_token_ids or []),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        **sampling_fields(args),
    )


def _prompt(text: str, chat: bool) -> Any:
    return ChatPrompt([{"role": "user", "content": text}]) if chat else text


def _print_stream(deltas: Iterable[StreamDelta], n: int) -> int:
    status = 0
    for delta in deltas:
        if delta.text:
            if n == 1:
                sys.stdout.write(delta.text)
            else:
                sys.stdout.write(f"[{delta.index}] {delta.text}\n")
            sys.stdout.flush()
        if delta.finish_reason == "error":
            print(f"\nerror: {delta.error or 'request failed'}", file=sys.stderr)
            status = 1
        elif delta.finish_reason == "abort":
            print(f"\n[{delta.request_id} aborted]", file=sys.stderr)
    if n == 1:
        sys.stdout.write("\n")
    return status


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    prompts = [_prompt(p, args.chat) for p in args.prompt]
    with LLMClient(args.address, timeout=args.timeout) as client:
        if args.stream:
            if len(prompts) != 1:
                raise ValueError("--stream takes exactly one prompt")
            deltas = client.stream(
                prompts[0],
                params,
                request_id=args.request_id,
                detached=args.detached,
                priority=args.priority,
                lora_adapter=args.lora_adapter,
            )
            return _print_stream(deltas, params.n)
        if len(prompts) == 1:
            # Streamed and folded here so that --request-id is used exactly (generate() treats
            # it as a prefix, "<id>-<i>", which is what several prompts get).
            out = RequestOutput.start(args.request_id or "", prompts[0], params.n)
            for delta in client.stream(
                prompts[0],
                params,
                request_id=args.request_id,
                priority=args.priority,
                lora_adapter=args.lora_adapter,
            ):
                out.add(delta)
            outputs = [out]
        else:
            outputs = client.generate(
                prompts,
                params,
                use_tqdm=not args.no_progress,
                request_id_prefix=args.request_id,
                priority=args.priority,
                lora_adapter=args.lora_adapter,
            )
    if args.json:
        print(json.dumps([o.to_dict() for o in outputs], indent=2))
    else:
        single = len(outputs) == 1 and len(outputs[0].outputs) == 1
        for out in outputs:
            for comp in out.outputs:
                suffix = f" #{comp.index}" if len(out.outputs) > 1 else ""
                print(comp.text if single else f"[{out.request_id}{suffix}] {comp.text}")
    failed = [o for o in outputs if o.error or any(c.finish_reason == "error" for c in o.outputs)]
    for out in failed:
        print(f"error: {out.request_id}: {out.error or 'request failed'}", file=sys.stderr)
    return 1 if failed else 0


_ABORT_WORDS = {
    AbortOutcome.ABORTED: "aborted",
    AbortOutcome.FINISHED: "already finished",
    AbortOutcome.PENDING: "not started yet: a request with this id will end aborted",
}


def cmd_abort(args: argparse.Namespace) -> int:
    with LLMClient(args.address, timeout=args.timeout) as client:
        outcome = client.abort(args.request_id)
    print(_ABORT_WORDS[outcome])
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with LLMClient(args.address, timeout=args.timeout) as client:
        info = client.server_info()
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    for key, value in info.to_dict().items():
        if key != "executors":
            print(f"{key}: {value}")
    for e in info.executors:
        state = "healthy" if e.healthy else "UNHEALTHY"
        if e.draining:
            state += ", draining"
        hits = (
            f"{e.prefix_cache_hits / e.prefix_cache_queries:.1%}" if e.prefix_cache_queries else "-"
        )
        print(
            f"executor {e.address} ({state}, instance {e.instance_id}): "
            f"{e.num_free_blocks}/{e.num_device_blocks} device blocks free, "
            f"{e.num_cpu_blocks} cpu blocks, prefix-cache hit rate {hits}"
            + (f", {e.dtype}" if e.dtype else "")
            + (f", cpu kernels {e.cpu_kernel_isa}" if e.cpu_kernel_isa else "")
        )
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with LLMClient(args.address, timeout=args.timeout) as client:
        state = client.get_request(args.request_id)
    if args.json:
        print(json.dumps(state.to_dict(), indent=2))
        return 0
    print(f"request_id: {state.request_id}")
    print(f"status: {state.status}")
    print(f"priority: {state.priority}")
    print(f"prompt tokens: {len(state.prompt_token_ids)}")
    if state.error:
        print(f"error: {state.error}")
    for seq in state.outputs:
        reason = seq.finish_reason or "-"
        print(f"[{seq.index}] {len(seq.token_ids)} tokens, finish_reason={reason}: {seq.text}")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with LLMClient(args.address, timeout=args.timeout) as client:
        state = client.get_request(args.request_id)
        n = max(len(state.outputs), 1)
        return _print_stream(client.resume(args.request_id, args.from_token_index), n)


def build_parser() -> argparse.ArgumentParser:
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument(
        "--address",
        default=None,
        help="scheduler host:port (default $LLMSERVE_ADDRESS or 127.0.0.1:50051)",
    )
    conn.add_argument("--timeout", type=float, default=30.0, help="seconds for unary calls")
    parser = argparse.ArgumentParser(prog="llmserve", description="llmserve client")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", parents=[conn], help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=16)
    gen.add_argument("--min-tokens", type=int, default=0)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stop-token-ids", type=int, nargs="+")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--logprobs", type=int, default=None)
    add_sampling_flags(gen)  # the optional features' (client/features.py)
    gen.add_argument("--priority", type=int, default=0)
    gen.add_argument("--lora-adapter", default="", help="a loaded LoRA adapter's name")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user message")
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--request-id", default=None)
    gen.add_argument(
        "--detached",
        action="store_true",
        help="with --stream: keep the request running if this command is stopped",
    )
    gen.add_argument("--json", action="store_true", help="print RequestOutputs as JSON")
    gen.add_argument("--no-progress", action="store_true")
    gen.set_defaults(func=cmd_generate)

    abort = sub.add_parser("abort", parents=[conn], help="abort a request by id")
    abort.add_argument("request_id")
    abort.set_defaults(func=cmd_abort)

    info = sub.add_parser("info", parents=[conn], help="model, limits, queues, executors")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    get = sub.add_parser("get", parents=[conn], help="status and output so far of a request")
    get.add_argument("request_id")
    get.add_argument("--json", action="store_true")
    get.set_defaults(func=cmd_get)

    resume = sub.add_parser("resume", parents=[conn], help="re-attach to a request's stream")
    resume.add_argument("request_id")
    resume.add_argument(
        "--from",
        dest="from_token_index",
        type=int,
        default=0,
        help="first output token index to print",
    )
    resume.set_defaults(func=cmd_resume)

    add_bench_parser(sub)
    add_health_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "address", None) is None:
        args.address = default_address()
    func = getattr(args, "func", None) or run_bench
    return run_guarded(func, args)


if __name__ == "__main__":
    sys.exit(main())
