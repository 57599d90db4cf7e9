"""Tensor parallelism with quantized weights: 2 CPU ranks over real gRPC, each holding the
blocks of its shard (a GGUF file's, or an HF checkpoint's quantized at load).

Each case serves one tiny random model twice: `llmserve-executor --tensor-parallel-size 2` (a
subprocess: rank 0 serves, rank 1 is its worker) and an in-process TP = 1 executor on the same
weights. Greedy outputs must be equal, several sequences batched with chunked prefills, and
logprobs within fp32 tolerance (the row-parallel layers sum two halves of each dot product, in
another order than one rank). For the GGUF cases, transformers' GGUF loader's greedy choices
too (teacher-forced on ours).

Cases: Llama GQA (Q8_0 attention and embedding, Q4_0 MLP and lm_head); Qwen2 with a tied
embedding (the lm_head's vocabulary shards come from the embedding's blocks) and an MLP width
whose half (48) is not whole 32-weight blocks (down_proj de-quantized on the ranks, logged);
`--quantization int4` of a Llama and `int8` of a Qwen3 with an odd vocabulary (the last rank's
lm_head rows are padding).
"""

from __future__ import annotations

import random

import pytest
import torch

from protos import executor_pb2 as pb
from tests.support.executor_driver import (
    ExecutorDriver,
    executor_channel,
    executor_subprocess,
    running_executor,
)
from tests.support.model_factory import make_tiny_checkpoint

gguf = pytest.importorskip("gguf")

MAX_NEW = 8
COMMON = ["--device", "cpu", "--block-size", "4", "--num-device-blocks", "128",
          "--swap-space", "0.0005", "--cpu-threads", "1"]  # fmt: skip
CASES = {
    "gguf-llama": ("llama", {"num_key_value_heads": 2}, None),
    "gguf-qwen2-tied-w96": (
        "qwen2",
        {"num_key_value_heads": 2, "tie_word_embeddings": True, "intermediate_size": 96},
        None,
    ),
    "int4-llama": ("llama", {"num_key_value_heads": 2}, "int4"),
    "int8-qwen3-odd-vocab": ("qwen3", {"num_key_value_heads": 2, "vocab_size": 509}, "int8"),
}
rng = random.Random(0)
PROMPTS = {f"p{i}": [rng.randrange(3, 509) for _ in range(n)] for i, n in enumerate([1, 6, 13, 22])}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, overrides, quantization = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    model = make_tiny_checkpoint(tmp / "hf", arch, seed=4, **overrides)
    extra: list[str] = []
    kwargs = dict(device="cpu", block_size=4, num_device_blocks=128, swap_space_gib=0.0005)
    if quantization is None:
        from tests.support.gguf_writer import write_gguf

        model = write_gguf(model, tmp / "g" / f"{arch}.gguf", arch)
    else:
        extra, kwargs["quantization"] = ["--quantization", quantization], quantization
    env = {"LLMSERVE_CACHE": str(tmp / "cache")}
    with (
        executor_subprocess(model, tmp, *COMMON, "--tensor-parallel-size", "2", *extra, env=env)
        as (_, tp2_port),
        running_executor(model, **kwargs) as (_, tp1_port),
    ):  # fmt: skip
        yield request.param, model, tp2_port, tp1_port, tmp


def _run(port: int, scenario):
    with executor_channel(port) as stub:
        stub.Reset(pb.ResetRequest())
        info = stub.Describe(pb.DescribeRequest())
        return info, scenario(ExecutorDriver(stub, info))


def test_greedy_equals_tp1(case) -> None:
    name, model, tp2_port, tp1_port, _ = case

    def scenario(d: ExecutorDriver):
        return d.generate(PROMPTS, MAX_NEW, chunk_sizes={"p3": 5, "p2": 4})

    info2, tp2 = _run(tp2_port, scenario)
    info1, tp1 = _run(tp1_port, scenario)
    assert info2.tensor_parallel_size == 2 and info1.tensor_parallel_size == 1
    assert info2.vocab_size == info1.vocab_size
    assert tp2 == tp1
    assert all(len(t) == MAX_NEW for t in tp2.values())
    if name.startswith("gguf"):
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(
            str(model.parent), gguf_file=model.name, dtype=torch.float32
        ).eval()
        for seq_id, prompt in PROMPTS.items():
            with torch.no_grad():
                logits = ref(torch.tensor([prompt + tp2[seq_id]])).logits[0, len(prompt) - 1 : -1]
            assert logits.argmax(-1).tolist() == tp2[seq_id], seq_id


def test_logprobs_close_to_tp1(case) -> None:
    _, _, tp2_port, tp1_port, _ = case
    params = pb.SamplingParams(num_logprobs=3)

    def scenario(d: ExecutorDriver):
        for seq_id, prompt in PROMPTS.items():
            d.add(seq_id, prompt, params)
        for _ in range(5):
            d.step()
        return {k: [(s.token_id, s.logprob) for s in v.outputs] for k, v in d.seqs.items()}

    _, tp2 = _run(tp2_port, scenario)
    _, tp1 = _run(tp1_port, scenario)
    for seq_id in PROMPTS:
        assert [t for t, _ in tp2[seq_id]] == [t for t, _ in tp1[seq_id]]
        assert [lp for _, lp in tp2[seq_id]] == pytest.approx(
            [lp for _, lp in tp1[seq_id]], abs=1e-4
        )


def test_each_rank_holds_its_shard_as_blocks(case) -> None:
    """Both ranks log their load: blocks kept (bytes or matrices), and where a row-parallel
    slice is not whole blocks, that layer de-quantized on the ranks."""
    import re

    name, _, _, _, tmp = case
    log = (tmp / "executor.log").read_text()
    if name.startswith("gguf"):
        held = [int(v) for v in re.findall(r"gguf.loaded.*?quantized=(\d+)", log)]
        dequantized = len(re.findall(r"gguf.tp_dequantized", log))
        # qwen2 w96: down_proj's slices are 48 wide, 2 layers on 2 ranks.
        assert dequantized == (4 if "w96" in name else 0), log[-2000:]
    else:
        held = [int(v) for v in re.findall(r"event='?quantized'?.*?matrices=(\d+)", log)]
    assert len(held) == 2 and all(h > 0 for h in held), log[-2000:]
