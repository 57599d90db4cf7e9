"""Multi-LoRA combined with the other ways of running a model (issue 31):

* a quantized base (``--quantization int8`` and ``int4``): the adapters' deltas are added to the
  quantized kernels' outputs (``models.llama.Linear`` runs its ``QuantWeight``, then its slot). The
  reference is HF + PEFT on the *de-quantized* base weights, the very matrices the runner holds
  (``QuantWeight.dequantize``): greedy outputs equal, mixed in one batch and alone, and a row's
  logits are bitwise those of the row alone whatever adapters ride along;
* speculative decoding: the verification step runs the target (base + the request's adapter) on
  the proposal positions too, all rows of a sequence in its adapter's group; the real scheduler
  core against a real executor servicer (tests/support/spec_driver.py) gives the same greedy and
  seeded tokens with speculation on and off, for requests of several adapters and the base.
"""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.features.lora.manager import LoraConfig
from executor_svc.runner.model_runner import ModelRunner
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.features.lora.ref import LoraRef
from scheduler_svc.features.spec.decode import SpeculativeConfig
from tests.support.lora_factory import SPECS, make_adapter
from tests.support.model_factory import load_hf_model, make_tiny_checkpoint
from tests.support.spec_driver import oracle, run_requests, with_proposer
from tests.unit.test_lora import NUM_NEW, Driver, _hf_greedy, _prompts

pytest.importorskip("peft")
pytestmark = pytest.mark.unit

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_combos")
    base = make_tiny_checkpoint(root / "base", "llama", seed=5, initializer_range=0.2)
    adapters = {s.name: str(make_adapter(base, root / s.name, s)) for s in SPECS}
    return base, adapters


def _runner(base, quantization: str | None = None) -> ModelRunner:
    return ModelRunner(
        base,
        block_size=BLOCK_SIZE,
        num_device_blocks=256,
        lora=LoraConfig(max_loras=5, max_cpu_loras=8),
        quantization=quantization,
    )


# ---------------------------------------------------------------- quantized base


def _dequantized_hf(runner: ModelRunner, base) -> torch.nn.Module:
    """The HF model of ``base`` with every matrix the runner quantized replaced by the runner's
    own de-quantized values (packed projections split back into HF's matrices)."""
    hf = load_hf_model(base)
    model = runner.model
    names = {
        ("self_attn", "qkv_proj"): {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
        ("self_attn", "o_proj"): {None: "o_proj"},
        ("mlp", "gate_up_proj"): {0: "gate_proj", 1: "up_proj"},
        ("mlp", "down_proj"): {None: "down_proj"},
    }
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            hf_layer = hf.model.layers[i]
            for (block, packed_name), parts in names.items():
                linear = getattr(getattr(layer, block), packed_name)
                w = linear.packed.dequantize()  # [out, in]
                for shard_id, hf_name in parts.items():
                    start, size = linear.shard_offsets[shard_id]
                    target = getattr(getattr(hf_layer, block), hf_name).weight
                    assert target.shape == (size, w.shape[1])
                    target.copy_(w[start : start + size])
        hf.lm_head.weight.copy_(model.packed_lm_head.dequantize())
    return hf


def _peft_on(hf: torch.nn.Module, adapter_dir: str) -> torch.nn.Module:
    from peft import PeftModel

    return PeftModel.from_pretrained(hf, adapter_dir).eval()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_base_with_adapters_matches_peft_on_dequantized_weights(
    base_and_adapters, scheme: str
):
    base, adapters = base_and_adapters
    runner = _runner(base, scheme)
    assert runner.model.layers[0].self_attn.qkv_proj.delta is not None
    names = [None, *adapters]
    prompts = _prompts(len(names), seed=3)
    loras = [(n, adapters[n]) if n else None for n in names]
    mixed = Driver(runner, prompts, loras)
    mixed.run()
    outs = []
    for i, name in enumerate(names):
        ref = _dequantized_hf(runner, base)
        if name is not None:
            ref = _peft_on(ref, adapters[name])
        want = _hf_greedy(ref, prompts[i])
        got = mixed.tokens[i][len(prompts[i]) :]
        assert got == want, f"adapter {name}"
        assert len(got) == NUM_NEW
        alone = Driver(_runner(base, scheme), [prompts[i]], [loras[i]])
        alone.run()
        assert alone.tokens[0] == mixed.tokens[i], f"adapter {name} alone vs mixed"
        outs.append(tuple(got))
    assert len(set(outs)) > 1  # the adapters changed the outputs


def test_int8_row_logits_do_not_depend_on_co_running_adapters(base_and_adapters):
    base, adapters = base_and_adapters
    ad = {n: (n, p) for n, p in adapters.items()}
    prompts = _prompts(5, seed=9)
    loras = [ad["all64"], None, ad["all64"], ad["qv8"], ad["mlp8"]]
    alone = Driver(_runner(base, "int8"), [prompts[0]], [loras[0]])
    ref = [alone.step({0: len(prompts[0])})]
    for _ in range(3):
        ref.append(alone.step({0: 1}))
    mixed = Driver(_runner(base, "int8"), prompts, loras)
    got = [mixed.step({i: len(p) for i, p in enumerate(prompts)})[:1]]
    got.append(mixed.step({0: 1, 3: 1})[:1])
    got.append(mixed.step({0: 1, 1: 1, 2: 1})[:1])
    got.append(mixed.step({i: 1 for i in range(5)})[:1])
    for step, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a, b), f"step {step}"


# ---------------------------------------------------------------- speculative decoding

SPEC = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=0)


def _spec_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    motif = [rng.randrange(3, 512) for _ in range(7)]
    return [
        motif * 4,  # the n-gram proposer finds matches at once
        list(range(7, 20)) * 2 + [3],
        [rng.randrange(3, 512) for _ in range(19)],
        motif * 3 + [5],
    ]


@pytest.fixture(scope="module")
def fp32_runner(base_and_adapters) -> ModelRunner:
    return _runner(base_and_adapters[0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=1),
        SamplingParams(temperature=0.9, seed=11, max_tokens=20),
    ],
    ids=["greedy", "seeded"],
)
def test_speculation_with_adapters_changes_no_token(base_and_adapters, fp32_runner, params):
    _, adapters = base_and_adapters
    prompts = _spec_prompts(seed=2)
    names = ["all64", None, "qv8", "all64"]
    loras = [LoraRef(n, adapters[n]) if n else None for n in names]
    reqs = [(p, params) for p in prompts]
    off = run_requests(fp32_runner, reqs, None, loras=loras)
    base_only = run_requests(fp32_runner, reqs, None)
    assert off.outputs["r0"] != base_only.outputs["r0"]  # the adapter matters
    ngram = run_requests(fp32_runner, reqs, SPEC, loras=loras)
    assert ngram.outputs == off.outputs
    assert ngram.proposed > 0
    for rate in (0.0, 0.3):
        proposer = oracle(off, prompts, rate, seed=4)
        on = with_proposer(lambda: run_requests(fp32_runner, reqs, SPEC, loras=loras), proposer)
        assert on.outputs == off.outputs, f"rate {rate}"
        assert on.proposed > 0
        if rate == 0.0:
            assert on.accepted == on.proposed and on.steps < off.steps / 2
        if params.logprobs is not None:
            assert on.logprobs == off.logprobs  # bit for bit


def test_speculation_with_adapters_on_an_int8_base(base_and_adapters):
    base, adapters = base_and_adapters
    runner = _runner(base, "int8")
    prompts = _spec_prompts(seed=5)
    loras = [LoraRef("mlp8", adapters["mlp8"]), None, LoraRef("ku16", adapters["ku16"]), None]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    reqs = [(p, params) for p in prompts]
    off = run_requests(runner, reqs, None, loras=loras)
    proposer = oracle(off, prompts, 0.2, seed=6)
    on = with_proposer(lambda: run_requests(runner, reqs, SPEC, loras=loras), proposer)
    assert on.outputs == off.outputs
    assert on.accepted > 0


def test_speculation_with_adapters_under_preemption_and_prefix_cache(
    base_and_adapters, fp32_runner
):
    """Few blocks: sequences of different adapters preempt each other (recompute and swap) while
    speculating; they share a prompt prefix, which the prefix cache must not share across
    adapters. Outputs equal those of a run without speculation nor prefix caching."""
    _, adapters = base_and_adapters
    rng = random.Random(8)
    motif = [rng.randrange(3, 500) for _ in range(16)]
    prompts = [motif + [rng.randrange(3, 500) for _ in range(3)] for _ in range(5)]
    names = ["all64", "qv8", None, "all64", "mlp8"]
    loras = [LoraRef(n, adapters[n]) if n else None for n in names]
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=32)
    reqs = [(p, params) for p in prompts]
    plain = run_requests(fp32_runner, reqs, None, loras=loras, enable_prefix_caching=False)
    for mode, cpu in (("recompute", 0), ("swap", 64)):
        kw = dict(num_device_blocks=36, preemption_mode=mode, num_cpu_blocks=cpu, loras=loras)
        on = with_proposer(
            lambda kw=kw: run_requests(fp32_runner, reqs, SPEC, **kw),
            oracle(plain, prompts, 0.1, seed=4),
        )
        assert on.outputs == plain.outputs, mode
        assert on.preemptions > 0 and on.accepted > 0, mode
