"""Multi-LoRA on the executor (executor_svc/features/lora): PEFT adapters (ranks 8 to 64, different
target modules, rsLoRA) loaded onto the packed projections give HF + PEFT's greedy outputs, alone
and mixed in one batch with the base model; a row's logits do not depend on which adapters ride
along (bitwise); bad adapters and too many adapters in a step are refused clearly."""

from __future__ import annotations

import json

import pytest
import torch

from executor_svc.features.lora import kernel as lora_kernel
from executor_svc.features.lora.manager import LoraConfig
from executor_svc.features.lora.peft import LoraError
from executor_svc.runner.model_runner import ModelRunner, ScheduledSequence
from tests.support.lora_factory import SPECS, load_peft_reference, make_adapter
from tests.support.model_factory import make_tiny_checkpoint

pytest.importorskip("peft")

BLOCK_SIZE = 4
NUM_NEW = 10


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", "llama", seed=5, initializer_range=0.2)
    adapters = {s.name: str(make_adapter(base, root / s.name, s)) for s in SPECS}
    return base, adapters


def _runner(base, max_loras=5, **kw) -> ModelRunner:
    cfg = LoraConfig(max_loras=max_loras, max_cpu_loras=max(8, max_loras), **kw)
    return ModelRunner(base, block_size=BLOCK_SIZE, num_device_blocks=96, lora=cfg)


class Driver:
    """Greedy decoding of sequences (each with its adapter or None) in shared steps."""

    def __init__(self, runner: ModelRunner, prompts, loras) -> None:
        self.runner = runner
        self.free = list(range(runner.num_device_blocks))
        self.tokens = [list(p) for p in prompts]
        self.num_prompt = [len(p) for p in prompts]
        self.computed = [0] * len(prompts)
        self.tables: list[list[int]] = [[] for _ in prompts]
        self.loras = loras  # per sequence: (name, path) or None

    def seq(self, i: int, n: int) -> ScheduledSequence:
        need = -(-(self.computed[i] + n) // BLOCK_SIZE) - len(self.tables[i])
        if need > 0:
            self.tables[i] += self.free[:need]
            self.free = self.free[need:]
        adapter = {"lora": self.loras[i]} if self.loras[i] else None  # SeqState.features
        return ScheduledSequence(
            str(i), list(self.tokens[i]), self.num_prompt[i], list(self.tables[i]),
            self.computed[i], n, None, features=adapter,
        )  # fmt: skip

    def step(self, schedule: dict[int, int]) -> torch.Tensor:
        seqs = [self.seq(i, n) for i, n in schedule.items()]
        idx, logits = self.runner.forward_logits(seqs)
        for i, n in schedule.items():
            self.computed[i] += n
        for j, k in enumerate(idx):
            self.tokens[int(seqs[k].seq_id)].append(int(logits[j].argmax()))
        return logits

    def run(self) -> None:
        self.step({i: len(t) for i, t in enumerate(self.tokens)})
        for _ in range(NUM_NEW - 1):
            self.step({i: 1 for i in range(len(self.tokens))})


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NUM_NEW,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (int(5 + 3 * i),), generator=g).tolist() for i in range(n)]


def test_mixed_batch_matches_hf_peft_for_each_adapter(base_and_adapters):
    base, adapters = base_and_adapters
    names = [None, *adapters]  # the base model and the 4 adapters in one batch
    prompts = _prompts(len(names), seed=1) * 2  # each prompt twice: mixed and alone
    loras = [(n, adapters[n]) if n else None for n in names]
    runner = _runner(base)
    mixed = Driver(runner, prompts[: len(names)], loras)
    mixed.run()
    from tests.support.model_factory import load_hf_model

    for i, name in enumerate(names):
        ref = load_hf_model(base) if name is None else load_peft_reference(base, adapters[name])
        want = _hf_greedy(ref, prompts[i])
        got = mixed.tokens[i][len(prompts[i]) :]
        assert got[: len(want)] == want, f"adapter {name}"
        alone = Driver(_runner(base), [prompts[i]], [loras[i]])
        alone.run()
        assert alone.tokens[0] == mixed.tokens[i], f"adapter {name} alone vs mixed"
    # The adapters changed the outputs (a test of nothing otherwise).
    assert len({tuple(mixed.tokens[i][len(prompts[i]) :]) for i in range(len(names))}) > 1
    base_ref = load_hf_model(base)
    assert any(
        _hf_greedy(base_ref, prompts[i]) != mixed.tokens[i][len(prompts[i]) :]
        for i in range(1, len(names))
    )


def test_row_logits_do_not_depend_on_co_running_adapters(base_and_adapters):
    """Bitwise: a sequence's prefill and decode logits alone, and among rows of the base model,
    of its own adapter (another sequence) and of other adapters, in changing groupings."""
    base, adapters = base_and_adapters
    ad = {n: (n, p) for n, p in adapters.items()}
    prompts = _prompts(6, seed=7)
    loras = [ad["all64"], None, ad["all64"], ad["qv8"], ad["mlp8"], ad["ku16"]]
    alone = Driver(_runner(base), [prompts[0]], [loras[0]])
    ref = [alone.step({0: len(prompts[0])})]
    for _ in range(3):
        ref.append(alone.step({0: 1}))
    mixed = Driver(_runner(base), prompts, loras)
    got = [mixed.step({i: len(p) for i, p in enumerate(prompts)})[:1]]
    got.append(mixed.step({0: 1, 3: 1})[:1])  # with one other adapter
    got.append(mixed.step({0: 1, 1: 1, 2: 1})[:1])  # the base and its own adapter
    got.append(mixed.step({i: 1 for i in range(6)})[:1])
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a, b), f"step {step}"


def test_too_many_adapters_in_a_step_is_refused(base_and_adapters):
    base, adapters = base_and_adapters
    runner = _runner(base, max_loras=2)
    loras = [(n, p) for n, p in adapters.items()][:3]
    d = Driver(runner, _prompts(3), loras)
    with pytest.raises(LoraError, match="max-loras"):
        d.step({0: 5, 1: 8, 2: 11})


def test_lru_caches_and_unload(base_and_adapters):
    base, adapters = base_and_adapters
    runner = ModelRunner(
        base,
        block_size=BLOCK_SIZE,
        num_device_blocks=32,
        lora=LoraConfig(max_loras=1, max_cpu_loras=2),
    )
    mgr = runner.features.handle("lora")
    for name in ("qv8", "mlp8", "qv8", "ku16"):
        mgr.load(name, adapters[name])
    assert mgr.names() == ["qv8", "ku16"]  # mlp8 was the least recently used
    assert mgr.stats.loads_from_disk == 3
    assert mgr.unload("qv8") and not mgr.unload("qv8")
    assert mgr.names() == ["ku16"]


def test_bad_adapters_are_refused_clearly(base_and_adapters, tmp_path):
    base, adapters = base_and_adapters
    mgr = _runner(base).features.handle("lora")
    with pytest.raises(LoraError, match="does not exist") as e:
        mgr.load("x", str(tmp_path / "missing"))
    assert e.value.not_found
    big = _runner(base, max_lora_rank=32).features.handle("lora")
    with pytest.raises(LoraError, match="exceeds --max-lora-rank 32"):
        big.load("all64", adapters["all64"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING", "r": 8}))
    with pytest.raises(LoraError, match="not LORA"):
        mgr.load("bad", str(bad))
    # an adapter of another base (other hidden size) is refused by its shapes
    other = make_tiny_checkpoint(tmp_path / "other", "llama", seed=1, hidden_size=32)
    wrong = make_adapter(other, tmp_path / "wrong", SPECS[0])
    with pytest.raises(LoraError, match="the base model needs"):
        mgr.load("wrong", str(wrong))


def test_runner_without_lora_refuses_an_adapter(base_and_adapters):
    base, adapters = base_and_adapters
    runner = ModelRunner(base, block_size=BLOCK_SIZE, num_device_blocks=16)
    d = Driver(runner, _prompts(1), [("qv8", adapters["qv8"])])
    with pytest.raises(LoraError, match="not enabled"):
        d.step({0: 5})


def test_bfloat16_follows_float32(base_and_adapters):
    """Off the fp32 LoRA kernel (here bf16) the apply is a grouped product per adapter, on the
    CPU through the packed bf16 GEMM (``gemm.pack``); the first greedy tokens match float32's."""
    base, adapters = base_and_adapters
    prompt = _prompts(1, seed=5)
    lora = [("all64", adapters["all64"])]
    runs = []
    for dtype in ("float32", "bfloat16"):
        cfg = LoraConfig(max_loras=2, max_cpu_loras=2)
        runner = ModelRunner(
            base, dtype=dtype, block_size=BLOCK_SIZE, num_device_blocks=32, lora=cfg
        )
        d = Driver(runner, prompt, lora)
        logits = d.step({0: len(prompt[0])})
        runs.append(logits.float())
        if dtype == "bfloat16":
            weights = runner.features.handle("lora")._on_device(lora[0]).weights  # noqa: SLF001
            assert not any(isinstance(ab, lora_kernel.LoraWeights) for ab in weights.values())
    assert runs[0].argmax(-1).tolist() == runs[1].argmax(-1).tolist()
    torch.testing.assert_close(runs[1], runs[0], rtol=0.1, atol=0.5)
