"""GGUF files of every served architecture (llama, mistral, qwen2 with q/k/v biases, qwen3 with
q_norm/k_norm), written offline from tiny HF checkpoints by tests/support/gguf_writer.py (Q8_0
attention and embedding, Q4_0 MLP and output, llama.cpp's q/k row order for llama/mistral), held
to transformers' own GGUF loader (which de-quantizes to fp32):

- the side directory's config and tokenizer (ids, decoding, chat template) equal transformers';
- our runner's logits, the weights kept as blocks, equal transformers' within LOGIT_ATOL;
- greedy continuations through chunked prefill and paged decode equal transformers' greedy
  choices (teacher-forced on ours: the same as its own greedy generation);
- an unsupported architecture or tensor type fails at ``prepare`` naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from executor_svc.features.gguf.hf_files import prepare
from executor_svc.features.gguf.reader import GGUFError
from executor_svc.kernels.quant import QuantWeight
from executor_svc.runner.model_runner import ModelRunner
from tests.support.model_factory import make_tiny_checkpoint
from tests.unit.test_model_equivalence import BLOCK_SIZE, GreedyDriver, all_token_logits

gguf = pytest.importorskip("gguf")

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# transformers' GGUF loader reads no head_dim for qwen3 (it keeps Qwen3Config's default, 128,
# which is what real Qwen3 models use), so the tiny qwen3 has head_dim 128. Rope bases other
# than the configs' default (10000), as the real models have, so rope.freq_base must be read.
ARCH_OVERRIDES = {
    "llama": {"rope_theta": 500000.0},
    "mistral": {"rope_theta": 1000000.0},
    "qwen2": {"rope_theta": 1000000.0},
    "qwen3": {"head_dim": 128, "rope_theta": 1000000.0},
}
# |our logit - transformers'|: both run the same de-quantized values in fp32, summed in other
# orders (our kernel's per-block chain vs a dense matmul). Measured max 3.1e-4 (llama, logits
# up to 17 in size, 2 layers); the bound is twice that.
LOGIT_ATOL = 6e-4
TEXTS = [
    "the cat sat on the mat",
    "Hello, world! 123",
    "  leading spaces\tand\ttabs\n\nnew lines",
    "émoji 🙂 中文",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "write a poem"}]


def vary_vectors(hf_dir: Path, seed: int = 7) -> Path:
    """Give the checkpoint's biases and norm weights random values (HF initialises them to 0
    and 1), so that a bias or a norm (qwen3's q_norm / k_norm) read into the wrong place shows."""
    from tests.support.model_factory import load_hf_model

    model = load_hf_model(hf_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                noise = torch.randn(param.shape, generator=gen)
                param.copy_(0.3 * noise if name.endswith("bias") else 1.0 + 0.2 * noise)
    model.save_pretrained(hf_dir)
    return hf_dir


class ArchCase:
    """One architecture's tiny checkpoint as a GGUF file, its side directory and transformers'
    GGUF-loaded model and tokenizer."""

    def __init__(self, root: Path, arch: str) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tests.support.gguf_writer import write_gguf

        self.arch = arch
        hf_dir = make_tiny_checkpoint(root / "hf", arch, seed=5, **ARCH_OVERRIDES.get(arch, {}))
        vary_vectors(hf_dir)
        self.gguf_path = write_gguf(hf_dir, root / "gguf" / f"{arch}.gguf", arch)
        self.src, self.name = str(self.gguf_path.parent), self.gguf_path.name
        self.side = prepare(self.gguf_path, cache=root / "cache")
        self.ref_tok = AutoTokenizer.from_pretrained(self.src, gguf_file=self.name)
        self.ref = AutoModelForCausalLM.from_pretrained(
            self.src, gguf_file=self.name, dtype=torch.float32
        ).eval()

    def runner(self, num_device_blocks: int = 64) -> ModelRunner:
        return ModelRunner(self.side, block_size=BLOCK_SIZE, num_device_blocks=num_device_blocks)

    def prompts(self) -> list[list[int]]:
        chat = self.ref_tok.apply_chat_template(CHAT, add_generation_prompt=True)
        chat = list(chat["input_ids"]) if hasattr(chat, "keys") else list(chat)
        return [chat, *(self.ref_tok(t).input_ids for t in TEXTS)]


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory) -> ArchCase:
    return ArchCase(tmp_path_factory.mktemp(f"gguf-{request.param}"), request.param)


def test_config_and_tokenizer_equal_transformers(case: ArchCase) -> None:
    from transformers import AutoConfig, AutoTokenizer

    ref_cfg = AutoConfig.from_pretrained(case.src, gguf_file=case.name).to_dict()
    cfg = AutoConfig.from_pretrained(case.side).to_dict()
    assert cfg["architectures"] == [
        {"llama": "LlamaForCausalLM", "mistral": "LlamaForCausalLM"}.get(
            case.arch, f"{case.arch.capitalize()}ForCausalLM"
        )
    ]
    for key in ("quantization_config", "architectures", "_name_or_path", "transformers_version"):
        ref_cfg.pop(key, None), cfg.pop(key, None)
    assert cfg == ref_cfg
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == 512
    assert cfg["rope_parameters"]["rope_theta"] == ARCH_OVERRIDES[case.arch]["rope_theta"]
    tok = AutoTokenizer.from_pretrained(case.side)
    for text in TEXTS:
        ids = case.ref_tok(text).input_ids
        assert tok(text).input_ids == ids
        assert tok.decode(ids) == case.ref_tok.decode(ids)
    # The special tokens stay whole; llama files add BOS (tokenizer.ggml.add_bos_token).
    ids = tok(TEXTS[-1]).input_ids
    assert ids[int(case.arch in ("llama", "mistral"))] == 1 and 2 in ids
    for gen in (True, False):
        assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen) == (
            case.ref_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        )
    assert (tok.eos_token_id, tok.bos_token_id) == (case.ref_tok.eos_token_id, 1)


def test_logits_match_transformers_gguf_loader(case: ArchCase) -> None:
    runner = case.runner()
    info, model = runner.info, runner.model
    assert (info.eos_token_ids, info.max_model_len, info.vocab_size) == ([2], 512, 512)
    assert info.head_dim == (128 if case.arch == "qwen3" else 16)
    # The weights stayed blocks: q|k|v Q8_0, gate|up Q4_0, the embedding and lm_head blocks.
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.qkv_proj.packed, QuantWeight) and attn.qkv_proj.packed.type_id == 8
    assert isinstance(mlp.gate_up_proj.packed, QuantWeight) and mlp.gate_up_proj.packed.type_id == 2
    assert model.quant_embedding is not None and model.packed_lm_head is not None
    assert model.packed_lm_head is not model.quant_embedding  # untied: its own Q4_0 blocks
    if case.arch == "qwen2":
        assert attn.qkv_proj.bias is not None and bool(attn.qkv_proj.bias.abs().min() > 0)
    prompts = case.prompts()
    ours = all_token_logits(runner, prompts)
    worst = 0.0
    with torch.no_grad():
        for p, got in zip(prompts, ours, strict=True):
            want = case.ref(torch.tensor([p])).logits[0]
            worst = max(worst, float((got - want).abs().max()))
    print(f"{case.arch}: max |logit - transformers'| = {worst:.2e}")
    assert worst < LOGIT_ATOL
    # The quantized kernels keep one chain per output element: alone or in a batch, same bits.
    for i in (0, 3):
        assert torch.equal(all_token_logits(runner, [prompts[i]])[0], ours[i])


def test_greedy_continuations_equal_transformers(case: ArchCase) -> None:
    prompts = case.prompts()[:4]
    num_new = 12
    d = GreedyDriver(case.runner(num_device_blocks=48), prompts)
    # A chunked prefill of prompt 0 beside the others' whole prompts, then paged decodes.
    d.step({0: 5, **{i: len(p) for i, p in enumerate(prompts) if i}})
    d.step({0: len(prompts[0]) - 5, **{i: 1 for i in range(1, len(prompts))}})
    while any(len(d.tokens[i]) - len(p) < num_new for i, p in enumerate(prompts)):
        d.decode_all([i for i, p in enumerate(prompts) if len(d.tokens[i]) - len(p) < num_new])
    # transformers teacher-forced on our tokens: its argmax at every output position equal to
    # our token is its own greedy continuation equal to ours, at one forward per prompt.
    for i, p in enumerate(prompts):
        ours = d.tokens[i][len(p) : len(p) + num_new]
        with torch.no_grad():
            logits = case.ref(torch.tensor([p + ours])).logits[0, len(p) - 1 : -1]
        assert logits.argmax(-1).tolist() == ours, f"{case.arch} prompt {i}"


def test_mistral_named_file_serves_as_mistral(tmp_path: Path) -> None:
    """general.name "mistral" makes transformers read a llama file as Mistral (its sliding
    window default caps the context); it cannot build that model with this gguf package, so
    the check is that we serve it with the same logits as the same tensors named otherwise."""
    from tests.support.gguf_writer import write_gguf

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "mistral", seed=5)
    logits = []
    for name in ("mistral", "Mistral-Tiny-v0.1"):
        path = write_gguf(hf_dir, tmp_path / name / "m.gguf", "mistral", name=name)
        side = prepare(path, cache=tmp_path / "cache")
        runner = ModelRunner(side, block_size=BLOCK_SIZE, num_device_blocks=16)
        want = "MistralForCausalLM" if name == "mistral" else "LlamaForCausalLM"
        assert runner.info.architecture == want
        logits.append(all_token_logits(runner, [[1, 40, 300, 7, 99, 12]])[0])
    assert torch.equal(logits[0], logits[1])


def test_unsupported_architecture_and_type_fail_at_prepare(tmp_path: Path) -> None:
    from tests.support.gguf_writer import write_gguf

    Q = gguf.GGMLQuantizationType
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "qwen2", seed=5)
    path = write_gguf(hf_dir, tmp_path / "a" / "m.gguf", "qwen2", ggml_arch="gemma")
    with pytest.raises(GGUFError, match=r"m\.gguf: architecture 'gemma' is not served"):
        prepare(path, cache=tmp_path / "cache")

    def q5_mlp(name: str):
        return Q.Q5_0 if ".ffn_up." in name else Q.Q8_0

    path = write_gguf(hf_dir, tmp_path / "t" / "m.gguf", "qwen2", matrix_type=q5_mlp)
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight has type Q5_0"):
        prepare(path, cache=tmp_path / "cache")


def test_qwen3_head_dim_transformers_cannot_read_fails_at_prepare(tmp_path: Path) -> None:
    """A qwen3 file whose heads are not 128 wide: transformers' loader would build 128-wide
    heads (it reads no key_length for qwen3); refused at prepare with the reason, not later on
    a tensor's shape."""
    from tests.support.gguf_writer import write_gguf

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "qwen3", seed=5)  # head_dim 32
    path = write_gguf(hf_dir, tmp_path / "g" / "m.gguf", "qwen3")
    with pytest.raises(GGUFError, match=r"heads are 32 wide .* reads head_dim 128 for qwen3"):
        prepare(path, cache=tmp_path / "cache")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tied_embedding_serves_the_lm_head_from_its_blocks(tmp_path: Path, arch: str) -> None:
    """No output.weight (Qwen2.5-0.5B, SmolLM2): transformers ties the head; ours runs it on the
    embedding's Q8_0 blocks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support.gguf_writer import write_gguf

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", arch, seed=6, tie_word_embeddings=True)
    path = write_gguf(vary_vectors(hf_dir), tmp_path / "g" / "m.gguf", arch)
    src, name = str(path.parent), path.name
    assert AutoConfig.from_pretrained(src, gguf_file=name).tie_word_embeddings is True
    runner = ModelRunner(prepare(path, cache=tmp_path / "c"), block_size=BLOCK_SIZE)
    assert runner.model.packed_lm_head is runner.model.quant_embedding
    ref = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32).eval()
    prompt = [1, 40, 300, 7, 99, 12, 3, 3, 200, 511]
    got = all_token_logits(runner, [prompt])[0]
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    assert float((got - want).abs().max()) < LOGIT_ATOL


def test_mixed_tensor_types_match_transformers(tmp_path: Path) -> None:
    """Types as a K-quant mix spreads them: q/k Q4_1 beside a Q8_0 v (one packed layer of two
    types: de-quantized to fp32 on load), o_proj BF16, gate/up F16, down Q4_0."""
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoModelForCausalLM

    from tests.support.gguf_writer import write_gguf

    types = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_output": Q.BF16, "ffn_gate": Q.F16}
    types |= {"ffn_up": Q.F16, "ffn_down": Q.Q4_0}

    def mixed(name: str):
        return types.get(name.split(".")[-2], Q.Q8_0)

    overrides = ARCH_OVERRIDES["qwen3"]
    hf_dir = vary_vectors(make_tiny_checkpoint(tmp_path / "hf", "qwen3", seed=8, **overrides))
    path = write_gguf(hf_dir, tmp_path / "g" / "m.gguf", "qwen3", matrix_type=mixed)
    runner = ModelRunner(prepare(path, cache=tmp_path / "c"), block_size=BLOCK_SIZE)
    layer = runner.model.layers[0]
    assert not isinstance(layer.self_attn.qkv_proj.packed, QuantWeight)  # mixed: fp32
    assert isinstance(layer.mlp.down_proj.packed, QuantWeight)
    src, name = str(path.parent), path.name
    ref = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32).eval()
    prompt = [1, 40, 300, 7, 99, 12, 3, 3, 200, 511, 17, 18]
    got = all_token_logits(runner, [prompt])[0]
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0]
    assert float((got - want).abs().max()) < LOGIT_ATOL
