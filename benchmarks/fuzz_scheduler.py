"""Fuzz a running scheduler as a hostile client would, and check it never loses its composure.

Sends `--messages` calls (default 10 000) spread over every public method plus health and
reflection: random bytes, valid messages truncated or with flipped bits, and well-formed
messages with hostile values (huge or negative counts, NaN and infinities, odd ids, empty and
huge prompts, out-of-vocabulary tokens, unknown chat roles, resumes from anywhere). Generation
is kept small (few tokens, short deadlines, streams cancelled early) so the run is bounded.

Checks, each printed as PASS or FAIL, then a last line `N passed, M failed`:
- no call ends with UNKNOWN or INTERNAL (bad input gets a status a person can act on);
- no stream ends with an error finish (garbage in one request never harms another);
- afterwards nothing is left running (every request the fuzz created is aborted or done);
- the scheduler still serves an ordinary request, and its health is SERVING;
- with `--log-file`, the scheduler's log holds no traceback.

    .venv/bin/python benchmarks/fuzz_scheduler.py                   # starts its own stack
    .venv/bin/python benchmarks/fuzz_scheduler.py --address HOST:PORT --log-file scheduler.log
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from protos import scheduler_pb2 as pb  # noqa: E402
from protos import scheduler_pb2_grpc as pb_grpc  # noqa: E402

SCHED = "/llmserve.v1.Scheduler/"
# (method, kind, request class): kind is uu (unary), us (server stream), ss (both streams).
METHODS = [
    (SCHED + "Generate", "us", pb.GenerateRequest),
    (SCHED + "Resume", "us", pb.ResumeRequest),
    (SCHED + "Abort", "uu", pb.AbortRequest),
    (SCHED + "GetRequest", "uu", pb.GetRequestRequest),
    (SCHED + "GetServerInfo", "uu", pb.GetServerInfoRequest),
    ("/grpc.health.v1.Health/Check", "uu", health_pb2.HealthCheckRequest),
    ("/grpc.health.v1.Health/Watch", "us", health_pb2.HealthCheckRequest),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "ss", None),
]
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
WEIRD_FLOATS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-30, 2.5, 1e30, -0.0]
WEIRD_INTS = [0, 1, 2, 7, 16, 17, 255, 2**16, 2**31 - 1, 2**32 - 1]
WEIRD_STRINGS = ["", " ", "x" * 300, "\x00", "\u202e", "é" * 5, "🙂", "a\nb", "%s%n", "../../etc"]


@dataclass
class FuzzResult:
    codes: collections.Counter = field(default_factory=collections.Counter)
    bad: list[str] = field(default_factory=list)  # calls that ended UNKNOWN / INTERNAL
    error_finishes: list[str] = field(default_factory=list)
    created_ids: set[str] = field(default_factory=set)
    num_messages: int = 0
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.checks.values())


class Fuzzer:
    def __init__(self, address: str, seed: int, result: FuzzResult) -> None:
        self.address = address
        self.rng = random.Random(seed)
        self.result = result
        self.lock = threading.Lock()
        self.channel = grpc.insecure_channel(address)

    # ------------------------------------------------------------ message makers

    def random_bytes(self, rng: random.Random) -> bytes:
        return rng.randbytes(rng.choice([1, 2, 5, 17, 64, 300]))

    def mangled(self, rng: random.Random, msg) -> bytes:
        data = bytearray(msg.SerializeToString())
        if data and rng.random() < 0.5:
            del data[rng.randrange(len(data)) :]
        for _ in range(rng.randint(1, 4)):
            if data:
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
        return bytes(data)

    def hostile_params(self, rng: random.Random) -> pb.SamplingParams:
        p = pb.SamplingParams()
        pick = rng.random
        if pick() < 0.5:
            p.n = rng.choice(WEIRD_INTS[:6])
        p.max_tokens = rng.choice([0, 1, 2, 4, 8, 2**32 - 1]) if pick() < 0.3 else rng.randint(1, 6)
        if pick() < 0.3:
            p.min_tokens = rng.choice(WEIRD_INTS)
        for name in ("temperature", "top_p", "repetition_penalty"):
            if pick() < 0.3:
                setattr(p, name, rng.choice(WEIRD_FLOATS))
        for name in ("min_p", "presence_penalty", "frequency_penalty"):
            if pick() < 0.2:
                setattr(p, name, rng.choice(WEIRD_FLOATS))
        if pick() < 0.3:
            p.top_k = rng.choice([-(2**31), -2, -1, 0, 1, 5, 511, 512, 100000, 2**31 - 1])
        if pick() < 0.3:
            p.seed = rng.choice([0, 1, 2**63 - 1, 2**63, 2**64 - 1])
        if pick() < 0.2:
            p.stop.extend(rng.choice(WEIRD_STRINGS) for _ in range(rng.choice([1, 2, 17])))
        if pick() < 0.2:
            p.stop_token_ids.extend(rng.choice(WEIRD_INTS) for _ in range(rng.choice([1, 65])))
        if pick() < 0.2:
            p.logprobs = rng.choice([0, 1, 5, 20, 21, 2**32 - 1])
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if pick() < 0.2:
                setattr(p, name, rng.random() < 0.5)
        return p

    def sane_params(self, rng: random.Random) -> pb.SamplingParams:
        return pb.SamplingParams(
            n=rng.choice([1, 1, 2]),
            max_tokens=rng.randint(1, 6),
            temperature=rng.choice([0.0, 0.7, 1.3]),
            logprobs=rng.choice([0, 0, 3]),
        )

    def hostile_generate(self, rng: random.Random) -> pb.GenerateRequest:
        params = self.sane_params(rng) if rng.random() < 0.3 else self.hostile_params(rng)
        r = pb.GenerateRequest(params=params)
        if rng.random() < 0.6:
            r.request_id = f"fuzz-{rng.getrandbits(40):x}"
        elif rng.random() < 0.5:
            r.request_id = rng.choice(WEIRD_STRINGS + ["x" * 257])
        kind = rng.random()
        if kind < 0.35:
            r.text = rng.choice(WEIRD_STRINGS + ["Once upon a time", "x" * 5000])
        elif kind < 0.7:
            n = rng.choice([0, 1, 3, 20, 600])
            r.token_ids.ids.extend(
                rng.choice([0, 1, 5, 300, 511, 512, 2**32 - 1]) for _ in range(n)
            )
        elif kind < 0.95:
            for _ in range(rng.choice([0, 1, 3])):
                role = rng.choice(["user", "system", "assistant", "tool", "root", "", "USER", "é"])
                r.chat.messages.add(role=role, content=rng.choice(WEIRD_STRINGS))
            if rng.random() < 0.3:
                r.chat.add_generation_prompt = rng.random() < 0.5
        r.detached = rng.random() < 0.3
        r.priority = rng.choice([0, 0, 1, -(2**31), 2**31 - 1])
        return r

    def request_for(self, rng: random.Random, method: str, cls):
        known = self.known_id(rng)
        if cls is pb.GenerateRequest:
            return self.hostile_generate(rng)
        if cls is pb.ResumeRequest:
            return pb.ResumeRequest(
                request_id=known, from_token_index=rng.choice([0, 1, 3, 1000, 2**32 - 1])
            )
        if cls in (pb.AbortRequest, pb.GetRequestRequest):
            return cls(request_id=known)
        if cls is health_pb2.HealthCheckRequest:
            return cls(service=rng.choice(["", "llmserve.v1.Scheduler", "nope", "x" * 300]))
        return cls() if cls is not None else None

    def known_id(self, rng: random.Random) -> str:
        with self.lock:
            ids = list(self.result.created_ids)
        if ids and rng.random() < 0.6:
            return rng.choice(ids)
        return rng.choice(["", "unknown-id", "x" * 300, "\x00", f"fuzz-{rng.getrandbits(40):x}"])

    # ------------------------------------------------------------ one call

    def one(self, i: int) -> None:
        rng = random.Random(self.rng_seed * 1_000_003 + i)
        method, kind, cls = rng.choice(METHODS)
        style = rng.random()
        msg = self.request_for(rng, method, cls)
        if msg is None or style < 0.25:
            payload = self.random_bytes(rng)
        elif style < 0.45:
            payload = self.mangled(rng, msg)
        else:
            payload = msg.SerializeToString()
        if cls is pb.GenerateRequest and msg is not None and msg.request_id:
            with self.lock:
                self.result.created_ids.add(msg.request_id)
        code = grpc.StatusCode.OK
        try:
            if kind == "uu":
                self.channel.unary_unary(method)(payload, timeout=5)
            elif kind == "us":
                # Watch never ends by itself: its first answer is all there is to see.
                watch = method.endswith("Watch")
                call = self.channel.unary_stream(method)(payload, timeout=1 if watch else 3)
                for j, raw in enumerate(call):
                    if not watch:
                        self.check_delta(method, raw)
                    if watch or j >= rng.choice([0, 2, 50]):
                        call.cancel()
                        break
            else:
                call = self.channel.stream_stream(method)(iter([payload]), timeout=3)
                for _ in call:
                    break
                call.cancel()
        except grpc.RpcError as e:
            code = e.code()
            if code in BAD_CODES:
                with self.lock:
                    self.result.bad.append(f"{method} {code.name}: {e.details()}")
        with self.lock:
            self.result.codes[(method.rsplit("/", 1)[1], code.name)] += 1
            self.result.num_messages += 1

    def check_delta(self, method: str, raw: bytes) -> None:
        if not method.endswith(("Generate", "Resume")):
            return
        delta = pb.GenerateResponse.FromString(raw)
        if delta.finish_reason == pb.FINISH_REASON_ERROR:
            with self.lock:
                self.result.error_finishes.append(f"{method} {delta.request_id}: {delta.error}")

    def run(self, messages: int, time_limit_s: float, workers: int) -> None:
        self.rng_seed = self.rng.getrandbits(32)
        deadline = time.monotonic() + time_limit_s
        with ThreadPoolExecutor(workers) as pool:
            futures = []
            for i in range(messages):
                if time.monotonic() > deadline:
                    break
                futures.append(pool.submit(self.one, i))
                if len(futures) >= 4 * workers:
                    futures.pop(0).result()
            for f in futures:
                f.result()

    # ------------------------------------------------------------ afterwards

    def settle(self, timeout_s: float = 60.0) -> bool:
        """Abort everything the fuzz created; True once nothing is left running."""
        stub = pb_grpc.SchedulerStub(self.channel)
        for req_id in sorted(self.result.created_ids):
            try:
                stub.Abort(pb.AbortRequest(request_id=req_id), timeout=5)
            except grpc.RpcError as e:
                if e.code() in BAD_CODES:
                    self.result.bad.append(f"Abort {e.code().name}: {e.details()}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
            if info.num_running == info.num_waiting == info.num_swapped == 0:
                return True
            time.sleep(0.2)
        return False

    def still_serves(self) -> bool:
        stub = pb_grpc.SchedulerStub(self.channel)
        req = pb.GenerateRequest(params=pb.SamplingParams(max_tokens=4, temperature=0.0))
        req.token_ids.ids.extend([5, 6, 7])
        deltas = list(stub.Generate(req, timeout=60))
        tokens = [t for d in deltas for t in d.token_ids]
        health = health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return len(tokens) == 4 and health.status == health_pb2.HealthCheckResponse.SERVING


def run_fuzz(
    address: str,
    *,
    messages: int = 10_000,
    seed: int = 0,
    time_limit_s: float = 600.0,
    workers: int = 8,
    log_file: Path | None = None,
) -> FuzzResult:
    result = FuzzResult()
    fuzzer = Fuzzer(address, seed, result)
    try:
        fuzzer.run(messages, time_limit_s, workers)
        settled = fuzzer.settle()
        result.checks["no UNKNOWN or INTERNAL status"] = not result.bad
        result.checks["no stream ended with an error finish"] = not result.error_finishes
        result.checks["nothing left running"] = settled
        result.checks["still serves, health SERVING"] = fuzzer.still_serves()
        if log_file is not None:
            time.sleep(0.5)  # let the last lines reach the file
            result.checks["no traceback in the log"] = "Traceback" not in log_file.read_text(
                errors="replace"
            )
    finally:
        fuzzer.channel.close()
    return result


def report(result: FuzzResult, elapsed_s: float) -> str:
    lines = [f"{result.num_messages} messages in {elapsed_s:.1f} s"]
    by_method: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (method, code), count in result.codes.items():
        by_method[method][code] += count
    for method in sorted(by_method):
        counts = ", ".join(f"{c} {n}" for c, n in by_method[method].most_common())
        lines.append(f"  {method}: {counts}")
    for what in result.bad[:10] + result.error_finishes[:10]:
        lines.append(f"  ! {what}")
    for name, ok in result.checks.items():
        lines.append(f"{'PASS' if ok else 'FAIL'}: {name}")
    passed = sum(result.checks.values())
    lines.append(f"{passed} passed, {len(result.checks) - passed} failed")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", help="a running scheduler (default: start a stack here)")
    ap.add_argument("--log-file", type=Path, help="the scheduler's log, checked for tracebacks")
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds for the sending")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    stack = redis = None
    address, log_file = args.address, args.log_file
    if address is None:
        import tempfile

        from scheduler_svc.local.redis_server import RedisServer
        from tests.support.stack import make_stack

        tmp = Path(tempfile.mkdtemp(prefix="llmserve-fuzz-"))
        (tmp / "stack").mkdir()
        redis = RedisServer(data_dir=tmp / "redis")
        redis.start()
        stack = make_stack(tmp / "stack", redis)
        address, log_file = stack.address, tmp / "stack" / "scheduler.log"
        print(f"stack on {address}, logs in {tmp / 'stack'}")
    t0 = time.monotonic()
    try:
        result = run_fuzz(
            address,
            messages=args.messages,
            seed=args.seed,
            time_limit_s=args.time_limit,
            workers=args.workers,
            log_file=log_file,
        )
    finally:
        if stack is not None:
            stack.stop()
            redis.close()
    print(report(result, time.monotonic() - t0))
    sys.exit(0 if result.ok else 1)


if __name__ == "__main__":
    main()
