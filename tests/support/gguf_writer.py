"""A tiny HF checkpoint (tests/support/model_factory.py) written as a GGUF file, the way llama.cpp's
converter lays one out, so that GGUF loading can be tested offline for every served architecture.

What the file holds, per architecture (``arch`` is model_factory's name):

- ``general.architecture``: ``llama`` for llama and mistral (llama.cpp converts Mistral as
  ``llama``; only ``general.name == "mistral"`` exactly makes transformers' GGUF loader build a
  MistralConfig, and with this gguf package it then cannot build the model), ``qwen2``,
  ``qwen3``.
- The hyper-parameters under the ``{arch}.`` keys transformers maps (context length, sizes, head
  counts, rms eps, rope base (default rope only); ``rope.dimension_count`` for llama; ``attention.key_length`` too,
  though transformers does not read it for qwen3: its head_dim is Qwen3Config's default, 128).
- q and k rows of llama / mistral permuted for llama.cpp's rope (pairs interleaved within each
  head); qwen2 / qwen3 rows as HF has them.
- ``output.weight`` only for an untied model (transformers infers tie_word_embeddings from it).
- A small byte-level BPE tokenizer (``tokenizer.ggml.model = gpt2``): three control tokens
  (ids 0-2: ``<|endoftext|>`` pad, ``<|im_start|>`` bos, ``<|im_end|>`` eos), the 256 byte
  symbols, then merges until ``vocab_size``; a ChatML chat template.
- Matrices (and the embedding) in the block types ``matrix_type`` picks, quantized by the
  ``gguf`` package itself; norms and biases F32.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tests.support.model_factory import load_hf_model

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def default_matrix_type(gguf_name: str):
    """Attention and the embedding in Q8_0, the MLP and the output in Q4_0: both block families."""
    from gguf import GGMLQuantizationType as Q

    return Q.Q4_0 if ".ffn_" in gguf_name or gguf_name.startswith("output.") else Q.Q8_0


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of HF checkpoint name ``hf_name``."""
    stem, _, kind = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, rest = stem.partition("model.layers.")
        layer, _, part = rest.partition(".")
        return f"blk.{layer}.{_HF_TO_GGUF_LAYER[part]}.{kind}"
    return f"{_HF_TO_GGUF_GLOBAL[stem]}.{kind}"


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: within each head, rows of the first and second rope halves
    interleaved (row i of half 0, row i of half 1, ...)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a small byte-level BPE: specials, the byte alphabet, then merges of
    a space or a letter with a letter, most frequent English letters first."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    space = bytes_to_unicode()[ord(" ")]
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    pairs = [(space, c) for c in letters] + [(a, b) for a in letters for b in letters]
    merges = pairs[: vocab_size - len(SPECIAL_TOKENS) - len(alphabet)]
    tokens = SPECIAL_TOKENS + alphabet + [a + b for a, b in merges]
    return tokens, [f"{a} {b}" for a, b in merges]


def write_gguf(
    model_dir: str | Path,
    out_path: str | Path,
    arch: str,
    *,
    matrix_type: Callable[[str], object] = default_matrix_type,
    name: str | None = None,
    ggml_arch: str | None = None,
) -> Path:
    """Write the checkpoint in ``model_dir`` (a model_factory ``arch`` model) as a GGUF file;
    ``name`` is ``general.name`` (default ``tiny-<arch>``); ``ggml_arch`` overrides
    ``general.architecture`` (to test refusals)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    model = load_hf_model(model_dir)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layout = GGUF_ARCH[arch]  # llama's rows permuted, qwen's not
    w = gguf.GGUFWriter(str(out_path), ggml_arch or layout)
    w.add_name(name or f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"only the default rope is written, not {rope}")
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    if layout == "llama":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)

    tokens, merges = byte_level_vocab(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_pad_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(layout == "llama")
    w.add_chat_template(CHAT_TEMPLATE)

    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = value.detach().to(torch.float32).numpy()
        if layout == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            t = permute_rows(t, heads)
        gname = gguf_name(name)
        qtype = matrix_type(gname) if t.ndim == 2 else Q.F32
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(
                gname, np.ascontiguousarray(t, np.float32 if qtype == Q.F32 else np.float16)
            )
        else:
            w.add_tensor(gname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out_path)
