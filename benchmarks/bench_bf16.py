"""bf16 on the CPU: our step-invariant bf16 GEMM and decode step against torch's bf16 (oneDNN)
and our fp32 path.

1. GEMMs: the matmuls of one decode step of the SmolLM-135M-shaped model (30 layers of qkv, o,
   gate_up, down, then the lm_head), at ``--batches`` rows, summed:
   * ours-bf16: ``gemm_bf16.Bf16PanelWeight`` (packed at load);
   * onednn-bf16: oneDNN's linear on a bf16 weight reordered once into its blocked layout
     (``torch.ops.mkldnn._linear_pointwise``, what inductor runs for a frozen model);
   * torch-bf16: ``F.linear`` on the plain ``[out, in]`` bf16 weight;
   * ours-fp32: ``gemm.PanelWeight`` (the fp32 default);
   * with ``--amx-variants``, where the amx kernel variant is loaded, the same packed weights
     with its settings changed for the call: ours-vdp (no tiles: vdpbf16ps and FMAs on the amx
     layout, other bits), ours-pfN (weights prefetched N tile steps ahead, not 4; 0 = none),
     ours-grouped (each tile step's loads before its products, not interleaved).
2. Decode step (``ModelRunner.execute``, CONTEXT tokens of context each, as bench_decode.py):
   fp32 (packed, our kernels), bf16 (packed bf16 GEMM), bf16 with torch's matmuls
   (``LLMSERVE_PREPACK=0``).

Everything alternates in one process, ``--repeats`` rounds (each starting one engine later than
the one before), medians shown, so background load and the order hit every variant alike. One torch thread by default (``--threads``).

    taskset -c 0 .venv/bin/python benchmarks/bench_bf16.py --threads 1
    .venv/bin/python benchmarks/bench_bf16.py --batches 1,8,64 --skip-decode \
        --engines ours-bf16 --amx-variants     # the amx variant's settings
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_decode import SMOLLM_135M, ours_step  # noqa: E402
from executor_svc.kernels import gemm, gemm_bf16, library  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner  # noqa: E402
from tests.support.model_factory import make_tiny_checkpoint  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 576, 1536, 49152, 30
SHAPES = [
    (HIDDEN, HIDDEN + 2 * 192),
    (HIDDEN, HIDDEN),
    (HIDDEN, 2 * INTER),
    (INTER, HIDDEN),
]  # (in, out) per layer


def _median_time(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _with_amx(what: int, value: int, fn):
    """``fn`` run with the amx variant's setting ``what`` (0: rows from which the tiles are
    taken, 1: prefetch distance, 2: load order) at ``value``."""
    lib = library.load()

    def call():
        before = lib.llmserve_gemm_bf16_amx_set(what, value)
        try:
            fn()
        finally:
            lib.llmserve_gemm_bf16_amx_set(what, before)

    return call


def amx_fns(fns: dict[str, object]) -> dict[str, object]:
    ours = fns["ours-bf16"]
    extra = {"ours-vdp": _with_amx(0, 1 << 62, ours)}
    for ahead in (0, 2, 8):
        extra[f"ours-pf{ahead}"] = _with_amx(1, ahead, ours)
    extra["ours-grouped"] = _with_amx(2, 0, ours)
    return extra


def gemm_fns(batch: int) -> dict[str, object]:
    """One decode step's matmuls for each engine, as a zero-argument callable."""
    g = torch.Generator().manual_seed(0)
    mats = [(torch.randn(k, n, generator=g) * 0.05) for k, n in SHAPES]
    head = torch.randn(HIDDEN, VOCAB, generator=g) * 0.05
    xs = {k: torch.randn(batch, k, generator=g) for k in (HIDDEN, INTER)}
    xb = {k: v.bfloat16() for k, v in xs.items()}
    ours_b = [gemm_bf16.pack(w.bfloat16()) for w in mats] + [gemm_bf16.pack(head.bfloat16())]
    ours_f = [gemm.PanelWeight.pack(w) for w in mats] + [gemm.PanelWeight.pack(head)]
    plain_b = [w.t().contiguous().bfloat16() for w in [*mats, head]]
    reorder = torch.ops.mkldnn._reorder_linear_weight
    onednn_b = [reorder(w, None) for w in plain_b]
    ins = [k for k, _ in SHAPES] + [HIDDEN]

    def run(ws, x, call):
        def step():
            for _ in range(LAYERS):
                for w, k in zip(ws[:4], ins[:4], strict=True):
                    call(w, x[k])
            call(ws[4], x[HIDDEN])

        return step

    return {
        "ours-bf16": run(ours_b, xb, lambda w, x: w.linear(x, None)),
        "onednn-bf16": run(
            onednn_b,
            xb,
            lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        ),
        "torch-bf16": run(plain_b, xb, lambda w, x: F.linear(x, w)),
        "ours-fp32": run(ours_f, xs, lambda w, x: w.linear(x, None)),
    }


def decode_fns(model_dir: Path, batch: int) -> dict[str, object]:
    fns = {}
    for name, dtype, prepack in (
        ("fp32", "float32", "1"),
        ("bf16-ours", "bfloat16", "1"),
        ("bf16-torch", "bfloat16", "0"),
    ):
        os.environ["LLMSERVE_PREPACK"] = prepack
        runner = ModelRunner(
            model_dir, device="cpu", dtype=dtype, block_size=16, num_device_blocks=batch * 9 + 8,
            swap_space_gib=0.01,
        )  # fmt: skip
        fns[name] = ours_step(runner, batch)
    os.environ["LLMSERVE_PREPACK"] = "1"
    return fns


def measure(fns: dict[str, object], repeats: int, iters: int) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(repeats):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            times[name].append(_median_time(fns[name], iters))
    return {k: statistics.median(v) for k, v in times.items()}


def report(title: str, res: dict[str, float], base: str) -> None:
    print(f"\n{title}")
    for name, t in res.items():
        print(f"  {name:12s} {t * 1e3:8.2f} ms   {res[base] / t:5.2f}x of {base}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--engines", default="", help="GEMM engines to time (default: all)")
    parser.add_argument("--amx-variants", action="store_true", help="amx settings (module doc)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    flags = set(library._cpu_features().split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")]
    print("cpu flags:", " ".join(f for f in isa if f in flags), "| kernel:", library.variant(),
          "| bf16 path:", gemm_bf16.isa_path(), "| threads:", args.threads)  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    with torch.inference_mode():
        for b in batches:
            fns = gemm_fns(b)
            extra = amx_fns(fns) if args.amx_variants and library.variant() == "amx" else {}
            if args.engines:  # onednn-bf16, the baseline, always
                keep = {"onednn-bf16", *args.engines.split(",")}
                fns = {k: v for k, v in fns.items() if k in keep}
            res = measure(fns | extra, args.repeats, args.iters)
            report(f"GEMMs of one decode step, batch {b}", res, "onednn-bf16")
        if args.skip_decode:
            return
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_tiny_checkpoint(
                Path(tmp) / "m", "llama", seed=0, tie_word_embeddings=True, **SMOLLM_135M
            )
            for b in batches:
                res = measure(decode_fns(model_dir, b), args.repeats, args.iters)
                report(f"decode step (ModelRunner.execute), batch {b}", res, "bf16-torch")


if __name__ == "__main__":
    main()
