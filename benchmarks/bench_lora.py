"""Multi-LoRA decode throughput and adapter swap-in time (executor_svc/features/lora).

Model: the SmolLM-135M-shaped random Llama of bench_decode.py (fp32, CPU). Adapters: PEFT
directories written here (random A and B, rank ``--rank``, every projection q/k/v/o/gate/up/down
unless ``--targets`` says otherwise), as ``peft`` saves them.

* throughput: one ``ModelRunner`` with LoRA on (``--max-loras`` 8) runs decode steps of
  ``--batch`` sequences with CONTEXT tokens cached (random KV, as bench_decode.py): all on the
  base model, and spread evenly over ``--adapters`` adapters, alternating step by step
  (``--repeats`` x ``--iters`` pairs); the median of the per-pair ratios (base step time /
  mixed step time) is the throughput of the mixed batch relative to the base model's.
* swap-in: an adapter read from its directory into the host cache (``from disk``), and from the
  host cache into the step's device slots (``from cache``: on a CPU device with fp32 weights
  that is the same memory, so it costs only the bookkeeping).

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/bench_lora.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.features.lora.manager import LoraConfig  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from executor_svc.runner.sampler import SamplingParams  # noqa: E402
from tests.support.model_factory import make_tiny_checkpoint  # noqa: E402

SMOLLM_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
}
CONTEXT = 128
BLOCK_SIZE = 16
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head
    return {
        "q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
        "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
    }  # fmt: skip


def write_adapter(out: Path, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """A PEFT LoRA directory with random weights (the layout ``peft`` saves)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(SMOLLM_135M["num_hidden_layers"]):
        for proj, (fan_in, fan_out) in _shapes(SMOLLM_135M).items():
            if proj not in targets:
                continue
            block = "self_attn" if proj in ALL[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def decode_step(runner: ModelRunner, batch: int, loras: list[tuple[str, str] | None]):
    seqs = []
    blocks_per_seq = -(-(CONTEXT + 1) // BLOCK_SIZE)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        tokens = torch.randint(3, SMOLLM_135M["vocab_size"], (CONTEXT + 1,), generator=g).tolist()
        table = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        adapter = {"lora": loras[i]} if loras[i] else None  # SeqState.features
        seqs.append(
            ScheduledSequence(
                str(i),
                tokens,
                CONTEXT,
                table,
                CONTEXT,
                1,
                SamplingParams(),
                features=adapter,
            )  # fmt: skip
        )
    return lambda: runner.execute(seqs, [], [], [])


def median_time(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(ALL))
    parser.add_argument("--repeats", type=int, default=5, help="alternating rounds")
    parser.add_argument("--iters", type=int, default=5, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    targets = tuple(args.targets.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = make_tiny_checkpoint(
            root / "smollm-135m-random", "llama", tie_word_embeddings=True, **SMOLLM_135M
        )
        paths = [
            str(write_adapter(root / f"a{i}", args.rank, targets, seed=i))
            for i in range(args.adapters + 1)
        ]
        runner = ModelRunner(
            model_dir,
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_device_blocks=args.batch * -(-(CONTEXT + 1) // BLOCK_SIZE),
            swap_space_gib=0.01,
            lora=LoraConfig(max_loras=args.adapters, max_lora_rank=64, max_cpu_loras=16),
        )
        mgr = runner.features.handle("lora")
        # Swap-in from disk: a fresh adapter read and checked; from the host cache: its device
        # copy dropped and made again.
        disk, cache = [], []
        for i, path in enumerate(paths):
            t0 = time.perf_counter()
            mgr.load(f"a{i}", path)
            disk.append(time.perf_counter() - t0)
        for i, path in enumerate(paths):
            mgr._device.clear()  # noqa: SLF001 - the benchmark measures the refill
            t0 = time.perf_counter()
            mgr._on_device((f"a{i}", path))  # noqa: SLF001
            cache.append(time.perf_counter() - t0)
        mgr._device.clear()  # noqa: SLF001
        base = decode_step(runner, args.batch, [None] * args.batch)
        spread = [(f"a{i % args.adapters}", paths[i % args.adapters]) for i in range(args.batch)]
        mixed = decode_step(runner, args.batch, spread)
        for _ in range(2):  # warm-up
            base()
            mixed()
        # Step by step, alternating, so that load from other processes hits both arms alike;
        # the ratio is the median of the per-pair ratios.
        t_base, t_mixed = [], []
        for _ in range(args.repeats * args.iters):
            t_base.append(median_time(base, 1))
            t_mixed.append(median_time(mixed, 1))
    b, m = statistics.median(t_base), statistics.median(t_mixed)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch}, "
          f"{args.adapters} adapters of rank {args.rank} on {','.join(targets)}")  # fmt: skip
    print(f"decode step, base model:      {b * 1e3:8.2f} ms  ({args.batch / b:7.1f} tok/s)")
    print(f"decode step, {args.adapters} adapters:     {m * 1e3:8.2f} ms  ({args.batch / m:7.1f} tok/s)")  # fmt: skip
    ratio = statistics.median(x / y for x, y in zip(t_base, t_mixed, strict=True))
    print(f"throughput ratio (adapters / base), median of {len(t_base)} pairs: {ratio:.3f}")
    print(f"swap-in from disk:  median {statistics.median(disk) * 1e3:.1f} ms per adapter")
    print(f"swap-in from cache: median {statistics.median(cache) * 1e3:.3f} ms per adapter")


if __name__ == "__main__":
    main()
