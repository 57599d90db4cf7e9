"""GGUF files checked at start-up (executor_svc/features/gguf/reader.py): an unsupported tensor type, a
truncated or foreign file, an unknown architecture each give a GGUFError naming the file and the
reason, before any model is built; the GGUF name mapping and the llama q/k row order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from executor_svc.features.gguf import reader, weights
from executor_svc.features.gguf.reader import GGUFError, GGUFFile

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def write_gguf(path: Path, arch: str = "llama", tensors: dict | None = None) -> Path:
    """A small GGUF file: metadata of a 1-layer model and the given {name: (array, type)}."""
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {
            "blk.0.attn_q.weight": (rng.standard_normal((64, 64)).astype(np.float32), Q.Q8_0),
            "blk.0.attn_norm.weight": (np.ones(64, dtype=np.float32), Q.F32),
        }
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(64)
    for name, (values, qtype) in tensors.items():
        if qtype in (Q.F32,):
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_a_valid_file(tmp_path: Path) -> None:
    f = GGUFFile(write_gguf(tmp_path / "m.gguf"))
    assert f.architecture == "llama" and f.hf_architecture == "LlamaForCausalLM"
    q = f.tensors["blk.0.attn_q.weight"]
    assert q.type_name == "Q8_0" and q.shape == (64, 64) and q.data.shape == (64, 68)
    assert q.hf_name == "model.layers.0.self_attn.q_proj.weight"
    assert f.type_counts() == {"Q8_0": 1, "F32": 1}


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    values = np.zeros((8, 64), dtype=np.float32)
    path = write_gguf(tmp_path / "q5.gguf", tensors={"blk.0.ffn_up.weight": (values, Q.Q5_0)})
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_up\.weight has type Q5_0.*supported: "):
        GGUFFile(path)


def test_truncated_file(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf: (corrupt or truncated|tensor .* holds)"):
        GGUFFile(cut)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not served"):
        GGUFFile(write_gguf(tmp_path / "g.gguf", arch="gpt2"))


def test_find_gguf(tmp_path: Path) -> None:
    assert reader.find_gguf(tmp_path) is None
    path = write_gguf(tmp_path / "a.gguf")
    assert reader.find_gguf(path) == path
    assert reader.find_gguf(tmp_path) == path
    write_gguf(tmp_path / "b.gguf")
    with pytest.raises(GGUFError, match="several GGUF files"):
        reader.find_gguf(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # an HF directory is not a GGUF model
    assert reader.find_gguf(tmp_path) is None


def test_names_map_to_hf() -> None:
    assert reader.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert reader.hf_name("output.weight") == "lm_head.weight"
    assert reader.hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert reader.hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert reader.hf_name("rope_freqs.weight") is None


def test_unpermute_rows_inverts_llamacpp_permutation() -> None:
    """llama.cpp's converter interleaves each head's two rope halves; undoing it restores HF."""
    heads, dim = 3, 8
    hf_rows = np.arange(heads * dim)
    permuted = hf_rows.reshape(heads, 2, dim // 2).swapaxes(1, 2).reshape(-1)  # the converter
    assert np.array_equal(permuted[weights._unpermute_rows(heads * dim, heads)], hf_rows)
