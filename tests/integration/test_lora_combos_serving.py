"""LoRA served on an int8 base with speculative decoding (issue 31 with issues 29 and 30), end to
end: an executor with `--enable-lora --quantization int8` and a scheduler with `--lora-modules`
and an n-gram `--speculative-config`. Requests of the base and of two adapters, mixed, give
exactly the tokens of the in-process runner on the same quantized weights with speculation off
(tests/unit/test_lora_combos.py holds those to HF + PEFT on the de-quantized weights), and the
scheduler really speculated (GetServerInfo's acceptance rate)."""

from __future__ import annotations

import json

import pytest

from executor_svc.features.lora.manager import LoraConfig
from executor_svc.runner.model_runner import ModelRunner
from protos import scheduler_pb2 as pb
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.features.lora.ref import LoraRef
from tests.support.api_helpers import collect, gen_request, run_in_threads, stub_for
from tests.support.lora_factory import SPECS, make_adapter
from tests.support.spec_driver import run_requests
from tests.support.stack import serving_stack, tiny_model_dir

pytest.importorskip("peft")
pytestmark = pytest.mark.integration

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0})
MOTIF = [11, 42, 7, 99, 23, 5]
PROMPTS = [MOTIF * 3, [5 + 3 * j for j in range(14)], MOTIF * 2 + [1, 2, 3] * 3, [8, 9] * 6]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-combos")
    model_dir = tiny_model_dir(tmp / "models")
    adapters = {s.name: make_adapter(model_dir, tmp / "adapters" / s.name, s) for s in SPECS[:2]}
    executor_args = ["--num-device-blocks", "256", "--swap-space", "0.05", "--enable-lora",
                     "--quantization", "int8"]  # fmt: skip
    scheduler_args = ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
                      "--speculative-config", SPEC]  # fmt: skip
    with serving_stack(tmp, model_dir, executor_args, scheduler_args) as stack:
        yield stack, model_dir, adapters


def test_int8_base_adapters_and_speculation_served(served):
    stack, model_dir, adapters = served
    names = [SPECS[0].name, None, SPECS[1].name, SPECS[0].name]
    channel, stub = stub_for(stack.address)

    def request(prompt: list[int], name: str | None) -> pb.GenerateRequest:
        req = gen_request(
            prompt, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
        req.lora_adapter = name or ""
        return req

    got = run_in_threads(
        [
            lambda p=p, n=n: collect(stub.Generate(request(p, n)))
            for p, n in zip(PROMPTS, names, strict=True)
        ]
    )
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    channel.close()
    assert all(g.error is None for g in got), [g.error for g in got]
    assert info.spec_decode_acceptance_rate > 0

    runner = ModelRunner(
        model_dir, block_size=16, num_device_blocks=256,
        lora=LoraConfig(max_loras=4, max_cpu_loras=4), quantization="int8",
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [LoraRef(n, str(adapters[n])) if n else None for n in names]
    ref = run_requests(runner, [(p, params) for p in PROMPTS], None, loras=loras)
    for i, g in enumerate(got):
        assert g.tokens[0] == ref.outputs[f"r{i}"][0], f"request {i} ({names[i]})"
    # The adapters change the outputs.
    base = run_requests(runner, [(PROMPTS[0], params)], None)
    assert ref.outputs["r0"][0] != base.outputs["r0"][0]
    # The base was quantized: fp32 weights give other tokens (the served ones are the int8 ones).
    fp32 = ModelRunner(
        model_dir,
        block_size=16,
        num_device_blocks=256,
        lora=LoraConfig(max_loras=4, max_cpu_loras=4),
    )
    unquantized = run_requests(fp32, [(p, params) for p in PROMPTS], None, loras=loras)
    assert unquantized.outputs != ref.outputs
