"""Which op first makes a position's numbers depend on the step around it (step invariance).

One position (the last of a 40-token prompt) is computed four ways: in a whole prefill alone, as
a one-token step after a 39-token prefill, that one-token step beside seven 30-token prefills,
and beside 63 other decodes. Forward hooks on every module of the model record the input and
the output row of that position; the first module (in execution order) whose row differs from
the whole-prefill reference is the op that breaks invariance. On the CPU kernels every row is
the same bits (that is what tests/unit/test_step_invariance.py holds); this is for CUDA, where
the invariance test is xfail (docs/benchmarks.md, "CUDA").

    python benchmarks/cuda_invariance_probe.py --device cuda
    LLMSERVE_CUDA_INVARIANT=1 python benchmarks/cuda_invariance_probe.py --device cuda
    python benchmarks/cuda_invariance_probe.py --device cpu --backend cpu   # control: no rows differ
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from executor_svc.config import numerics  # noqa: E402
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence  # noqa: E402
from tests.support.model_factory import make_tiny_checkpoint  # noqa: E402

BS = 16
SHAPE = {
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
}
GREEDY = None  # the runner samples nothing here: logits are computed by hand


class Recorder:
    """Per module (execution order): (input row, output row) of the probed row of a step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.row = 0
        self.rows: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []
        for name, mod in model.named_modules():
            if name:
                mod.register_forward_hook(self._hook(name))

    def _pick(self, x: object) -> torch.Tensor | None:
        if isinstance(x, tuple | list):
            x = next((t for t in x if isinstance(t, torch.Tensor)), None)
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] > self.row:
            return x[self.row].detach().float().cpu().clone()
        return None

    def _hook(self, name: str):
        def hook(_mod, inputs, output):
            self.rows.append((name, self._pick(inputs), self._pick(output)))

        return hook


def run(runner: ModelRunner, rec: Recorder, seqs: list[ScheduledSequence], row: int) -> list:
    rec.rows, rec.row = [], row
    with torch.inference_mode():
        batch = runner.prepare_inputs(seqs)
        hidden = runner.model(
            batch.input_ids, batch.positions, runner.kv_cache.layers, batch.attn_metadata
        )
        logits = runner.model.compute_logits(hidden[row : row + 1]).float().cpu()
    return [*rec.rows, ("logits", None, logits[0])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-deterministic", action="store_true", help="the fast numerics")
    args = ap.parse_args()
    numerics.set_deterministic(not args.no_deterministic)
    tmp = Path(tempfile.mkdtemp())
    model_dir = make_tiny_checkpoint(tmp / "m", "llama", seed=3, **SHAPE)
    runner = ModelRunner(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.backend,
        block_size=BS,
        num_device_blocks=512,
        swap_space_gib=0.01,
    )
    rec = Recorder(runner.model)
    rng = random.Random(0)
    vocab = SHAPE["vocab_size"]
    prompt = [rng.randrange(vocab) for _ in range(40)]
    others = [[rng.randrange(vocab) for _ in range(30)] for _ in range(63)]
    next_block = [0]

    def seq(sid: str, toks: list[int], done: int, n: int) -> ScheduledSequence:
        blocks = list(range(next_block[0], next_block[0] + -(-len(toks) // BS)))
        next_block[0] += len(blocks)
        return ScheduledSequence(sid, toks, len(toks), blocks, done, n, GREEDY)

    def fresh(sid: str, toks: list[int], done: int, n: int) -> ScheduledSequence:
        """A sequence on new blocks, its first `done` tokens prefilled alone."""
        s = seq(sid, toks, 0, done)
        if done:
            run(runner, rec, [s], 0)
        return ScheduledSequence(sid, toks, len(toks), s.block_table, done, n, GREEDY)

    ref = run(runner, rec, [fresh("a", prompt, 0, 40)], 39)
    cases = {}
    cases["one-token step alone"] = run(runner, rec, [fresh("b", prompt, 39, 1)], 0)
    mixed = [fresh("c", prompt, 39, 1)] + [
        fresh(f"o{i}", o, 0, 30) for i, o in enumerate(others[:7])
    ]
    cases["one-token step + 7 prefills of 30"] = run(runner, rec, mixed, 0)
    decodes = [fresh("d", prompt, 39, 1)] + [fresh(f"p{i}", o, 29, 1) for i, o in enumerate(others)]
    cases["one-token step + 63 decodes"] = run(runner, rec, decodes, 0)

    print(f"device={args.device} backend={args.backend} dtype={args.dtype} "
          f"torch={torch.__version__}")  # fmt: skip
    for name, got in cases.items():
        first = None
        for (mod, ri, ro), (mod2, gi, go) in zip(ref, got, strict=True):
            assert mod == mod2
            for what, a, b in (("input", ri, gi), ("output", ro, go)):
                if a is not None and b is not None and not torch.equal(a, b):
                    first = first or (mod, what, (a - b).abs().max().item())
        lg = (ref[-1][2] - got[-1][2]).abs().max().item()
        print(f"{name}: logits max |diff| {lg:.3g}; first differing: {first or 'none'}")


if __name__ == "__main__":
    main()
