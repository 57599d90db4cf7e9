"""The compiled CPU paged-attention kernel against the torch reference, and its fallback.

The kernel is built on first use with the system compiler; without one these tests that need it
skip, and the fallback test still checks that "auto" then picks the torch backend.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from executor_svc.attention import AttentionMetadata, cpu_ops, get_attention_backend
from executor_svc.attention.torch_ops import paged_attention_naive
from executor_svc.kernels import library
from tests.unit.test_torch_attention import dense_reference, make_batch

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")


def check(q_lens, seq_lens, **kw):
    query, kc, vc, bt, sl, qsl, dense = make_batch(q_lens, seq_lens, **kw)
    scale = query.shape[-1] ** -0.5
    out = cpu_ops.paged_attention(query, kc, vc, bt, sl, qsl, scale)
    assert out.shape == query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, dense_reference(query, qsl, dense, scale), atol=2e-5, rtol=1e-4)
    return query, kc, vc, bt, sl, qsl, out


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (9, 3), (6, 1)])
def test_decode_batch_gqa(num_heads, num_kv_heads):
    check([1] * 6, [1, 15, 16, 17, 70, 300], num_heads=num_heads, num_kv_heads=num_kv_heads,
          head_dim=64)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("head_dim", [8, 24, 40, 72, 32, 64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_prefill_chunks_and_decodes_any_head_dim(head_dim, block_size):
    # Whole prompts, chunks after a cached prefix, decodes, and a 1-token context, in one batch.
    check([5, 1, 40, 1, 17, 1], [5, 33, 100, 1, 17, 64], head_dim=head_dim,
          block_size=block_size, num_heads=6, num_kv_heads=2)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("block_size", [8, 16])
def test_long_contexts_span_several_score_chunks(block_size):
    # The vectorised path takes keys in chunks of at most 32 blocks, with the softmax carried
    # from one chunk to the next: decodes and prefill chunks far past one chunk, and a chunk
    # whose first tile of queries sees fewer keys than its last (causal within the chunk).
    check([1, 1, 40, 16], [700, 1100, 1040, 600], block_size=block_size, num_heads=9,
          num_kv_heads=3, head_dim=64)  # fmt: skip


def share_prefix(bt, dense, members, blocks, block_size):
    """Point the tables of `members` at the first sequence's first `blocks` blocks (what the
    prefix cache does for a common system prompt) and make their reference K/V agree."""
    first, n = members[0], blocks * block_size
    for j in members[1:]:
        bt[j, :blocks] = bt[first, :blocks]
        k, v = dense[j]
        dense[j] = (
            torch.cat([dense[first][0][:n], k[n:]]),
            torch.cat([dense[first][1][:n], v[n:]]),
        )


@needs_kernel
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 8), (40, 16)])
def test_sequences_sharing_a_prefix_attend_to_it_together(head_dim, block_size):
    """Sequences whose tables start with the same blocks: the kernel attends to those blocks
    once for the group (then each sequence's own blocks from that state). Decodes and prefill
    chunks after the prefix, a member whose chunk starts inside the shared blocks (so the group
    shares fewer), a sequence sharing too little to group, and one outside any group."""
    q_lens = [1, 1, 33, 1, 40, 1, 2]
    seq_lens = [200, 137, 300, 90, 150, 70, 40]
    query, kc, vc, bt, sl, qsl, dense = make_batch(q_lens, seq_lens, head_dim=head_dim,
                                                   block_size=block_size, num_heads=9,
                                                   num_kv_heads=3)  # fmt: skip
    share_prefix(bt, dense, [0, 1, 2, 4], 128 // block_size, block_size)  # 4 sees < 128 keys
    share_prefix(bt, dense, [3, 5], 2, block_size)  # below the kernel's minimum: no group
    scale = head_dim**-0.5
    out = cpu_ops.paged_attention(query, kc, vc, bt, sl, qsl, scale)
    torch.testing.assert_close(out, dense_reference(query, qsl, dense, scale), atol=2e-5, rtol=1e-4)


@needs_kernel
def test_matches_the_per_token_loop_and_strided_queries():
    query, kc, vc, bt, sl, qsl, _ = make_batch([3, 1, 20], [10, 44, 20], head_dim=16)
    # The model hands over q as a view of q|k after rope: rows strided, heads contiguous.
    qk = torch.cat([query, torch.randn(query.shape[0], 2, 16)], dim=1)
    strided = qk[:, :4]
    assert not strided.is_contiguous()
    out = cpu_ops.paged_attention(strided, kc, vc, bt, sl, qsl, 0.3)
    torch.testing.assert_close(
        out, paged_attention_naive(query, kc, vc, bt, sl, qsl, 0.3), atol=2e-5, rtol=1e-4
    )


@needs_kernel
def test_two_threads_give_the_same_result():
    batch = make_batch([1, 30, 1, 1], [50, 30, 7, 200], head_dim=64, num_heads=8, num_kv_heads=2)
    query, kc, vc, bt, sl, qsl, _ = batch
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_attention(query, kc, vc, bt, sl, qsl, 0.125)
        torch.set_num_threads(2)
        two = cpu_ops.paged_attention(query, kc, vc, bt, sl, qsl, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # items are independent: same arithmetic whatever the split


@needs_kernel
def test_backend_writes_then_attends_and_auto_picks_it():
    backend = get_attention_backend("auto", "cpu")
    assert backend.name == "cpu"
    q_lens, seq_lens = [1, 4], [9, 4]
    query, kc, vc, bt, sl, qsl, dense = make_batch(q_lens, seq_lens, block_size=8)
    # New K/V of the step go through attend(): overwrite the last positions with fresh values.
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    slots = torch.tensor(
        [int(bt[0, 8 // 8]) * 8 + 0] + [int(bt[1, 0]) * 8 + p for p in range(4)], dtype=torch.long
    )
    md = AttentionMetadata(slot_mapping=slots, block_tables=bt, seq_lens=sl, query_start_loc=qsl,
                           max_query_len=4, max_seq_len=9)  # fmt: skip
    out = backend.attend(query, key, value, kc, vc, md, 0.25)
    dense[0] = (torch.cat([dense[0][0][:8], key[:1]]), torch.cat([dense[0][1][:8], value[:1]]))
    dense[1] = (key[1:], value[1:])
    torch.testing.assert_close(out, dense_reference(query, qsl, dense, 0.25), atol=2e-5, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (40, 8)])
def test_rope_write_and_attention_in_one_call_match_the_separate_ops(head_dim, block_size):
    """attend_rope (the model's path on this backend) against rotating q and k with the model's
    RotaryEmbedding and running the torch backend's attend: prefill chunks, decodes and a
    skipped slot (-1) in one batch, GQA, the vectorised and the generic head_dim paths."""
    from executor_svc.models.llama import RotaryEmbedding

    h, kvh = 6, 2
    q_lens, seq_lens = [1, 20, 3, 1], [30, 20, 40, 1]
    query, kc, vc, bt, sl, qsl, _ = make_batch(q_lens, seq_lens, head_dim=head_dim,
                                               block_size=block_size, num_heads=h,
                                               num_kv_heads=kvh)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    # The layer's packed projection: q, k, v heads side by side in each row, as llama.py slices it.
    qkv = torch.randn(sum(q_lens), (h + 2 * kvh) * head_dim, generator=g)
    qk = qkv[:, : (h + kvh) * head_dim].view(-1, h + kvh, head_dim)
    v = qkv[:, (h + kvh) * head_dim :].view(-1, kvh, head_dim)
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens, strict=True)])
    slots = torch.cat([  # each new token's cache slot: its block's id * block_size + offset
        bt[i].long()[pos // block_size] * block_size + pos % block_size
        for i, pos in enumerate(torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens, strict=True))
    ])  # fmt: skip
    slots[5] = -1  # a token whose K/V is already cached (e.g. recomputed): not written
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None)
    cos, sin = rope.cos_sin(positions, torch.float32)

    def metadata():
        return AttentionMetadata(slot_mapping=slots, block_tables=bt, seq_lens=sl,
                                 query_start_loc=qsl, max_query_len=20, max_seq_len=40)  # fmt: skip

    kc2, vc2 = kc.clone(), vc.clone()
    fused = cpu_ops.attend_rope(qk, v, cos, sin, h, kc, vc, metadata(), head_dim**-0.5)
    rotated = RotaryEmbedding.apply(qk, cos, sin)
    ref = get_attention_backend("torch", "cpu").attend(
        rotated[:, :h], rotated[:, h:], v, kc2, vc2, metadata(), head_dim**-0.5
    )
    assert fused is not None
    torch.testing.assert_close(kc, kc2, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(vc, vc2, atol=0, rtol=0)
    torch.testing.assert_close(fused, ref, atol=2e-5, rtol=1e-4)
    # Inputs it does not take (bf16) are left to the caller.
    assert cpu_ops.attend_rope(qk.bfloat16(), v, cos, sin, h, kc, vc, metadata(), 0.1) is None


def test_bfloat16_cache_and_rows_go_through_the_kernel():
    """bf16 rows over a bf16 cache: the kernel's bf16-K/V build (fp32 inside), a bf16 result."""
    query, kc, vc, bt, sl, qsl, dense = make_batch([1, 3], [20, 3], dtype=torch.bfloat16)
    out = cpu_ops.paged_attention(query, kc, vc, bt, sl, qsl, 0.25)
    assert out.dtype == torch.bfloat16
    ref = dense_reference(query, qsl, dense, 0.25)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_without_a_compiler_auto_falls_back_to_torch(tmp_path):
    """A fresh process with no compiler on PATH and an empty kernel cache: torch is chosen."""
    code = (
        "from executor_svc.attention import cpu_ops, get_attention_backend;"
        "assert not cpu_ops.available();"
        "b = get_attention_backend('auto', 'cpu');"
        "assert b.name == 'torch', b.name;"
        "print('fallback ok')"
    )
    env = dict(os.environ, PATH=str(tmp_path), CXX="", LLMSERVE_KERNEL_DIR=str(tmp_path / "k"))
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "fallback ok" in result.stdout


def test_a_prebuilt_library_serves_without_a_compiler(tmp_path):
    """What the Docker image does: no compiler, $LLMSERVE_KERNEL_LIB built ahead of time for
    x86-64-v3; on a CPU with those features the kernel is used and matches the reference."""
    import shutil

    cxx = shutil.which("g++")
    features = set(library._cpu_features().split())
    if cxx is None or not set(library.PORTABLE_FEATURES) <= features:
        pytest.skip("needs g++ to build the library and an x86-64-v3 CPU to run it")
    # The avx2 variant is the x86-64-v3 build (the Dockerfile's flags): the library cache's copy
    # (built once per source hash, by any test that loads that variant) stands for the image's.
    assert library.VARIANTS["avx2"][0] == (library.PORTABLE_MARCH,)
    built, name = library._build("avx2")
    assert built is not None and name == "avx2", "the x86-64-v3 build failed"
    lib = tmp_path / "paged_attention-x86-64-v3.so"
    shutil.copyfile(built, lib)
    code = (
        "import torch\n"
        "from executor_svc.attention import cpu_ops, get_attention_backend\n"
        "from tests.unit.test_torch_attention import dense_reference, make_batch\n"
        "assert cpu_ops.available()\n"
        "assert get_attention_backend('auto', 'cpu').name == 'cpu'\n"
        "q, kc, vc, bt, sl, qsl, dense = make_batch([1, 5], [40, 5], num_heads=4,"
        " num_kv_heads=2, head_dim=24)\n"
        "out = cpu_ops.paged_attention(q, kc, vc, bt, sl, qsl, 0.3)\n"
        "torch.testing.assert_close(out, dense_reference(q, qsl, dense, 0.3), atol=2e-5,"
        " rtol=2e-5)\n"
        "print('prebuilt ok')\n"
    )
    env = dict(
        os.environ,
        PATH=str(tmp_path),
        CXX="",
        LLMSERVE_KERNEL_DIR=str(tmp_path / "k"),
        LLMSERVE_KERNEL_LIB=str(lib),
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prebuilt ok" in result.stdout
