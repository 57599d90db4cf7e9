"""Step invariance, op by op: a row's result must not depend on the other rows of its call.

The model-level property test (test_step_invariance.py) proves the whole forward; these pin down
each piece it rests on, with one and two threads: the CPU attention kernel (rows alone against
the same rows among co-runners, prefill tiles, split heads, shared-prefix groups), the
elementwise kernels and the sampler's reductions, and the torch ops the torch backend relies on
(``exp``'s vector and tail lanes agree; ``cumsum`` adds in order whatever the shape).
"""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.attention import cpu_ops
from executor_svc.kernels import elementwise, sampling
from executor_svc.runner.sampler import Sampler, SamplingParams

needs_kernel = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler for the kernels")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# -- attention kernel -------------------------------------------------------------------------


def _attend(q, kc, vc, tables, seq_lens, q_lens):
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    width = max(len(t) for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return cpu_ops.paged_attention(
        q, kc, vc, bt, torch.tensor(seq_lens, dtype=torch.int32), qsl, 0.17
    )


@needs_kernel
@pytest.mark.parametrize("group_q", [3, 14], ids=["group-rows", "group-lanes"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (32, 8, 32), (6, 6, 16)])
def test_attention_row_alone_equals_row_among_co_runners(
    threads, heads, kv_heads, head_dim, cache_dtype, group_q
):
    """Each query row of a mixed step (decodes, prefill chunks, a shared 160-token prefix on
    three sequences, contexts across the 128-key chunk boundary) equals the same position
    computed alone as a one-token decode. Prefill chunks and a group with 16 or more rows per
    KV head (group_q = 14 tokens in its first sequence) take the kernel's rows-in-lanes walk
    (attention_rows.h); the one-token decodes and a smaller group (group_q = 3, except with
    32 heads on 8) take the row-by-row one."""
    rng = random.Random(heads * 100 + threads)
    torch.manual_seed(heads + threads)
    bs, num_blocks = 16, 256
    kc = torch.randn(num_blocks, bs, kv_heads, head_dim).to(cache_dtype)
    vc = torch.randn(num_blocks, bs, kv_heads, head_dim).to(cache_dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop() for _ in range(10)]  # 160 tokens: past one chunk
    seqs = []  # (table, seq_len, q_len)
    for i in range(12):
        seq_len = rng.randint(1, 300)
        q_len = 1 if i % 2 else rng.randint(1, min(seq_len, 40))
        if i < 3:
            seq_len, q_len = 160 + rng.randint(1, 60), 1 if i else group_q
        nb = -(-seq_len // bs)
        table = (shared[:nb] if i < 3 else []) + [
            free.pop() for _ in range(nb - (10 if i < 3 else 0))
        ]
        seqs.append((table[:nb], seq_len, q_len))
    q_lens = [q for _, _, q in seqs]
    q = torch.randn(sum(q_lens), heads, head_dim)
    batch = _attend(q, kc, vc, [t for t, _, _ in seqs], [n for _, n, _ in seqs], q_lens)
    row = 0
    for table, seq_len, q_len in seqs:
        for j in range(q_len):
            pos = seq_len - q_len + j
            alone = _attend(q[row : row + 1], kc, vc, [table], [pos + 1], [1])
            assert torch.equal(batch[row], alone[0]), (seq_len, q_len, j)
            row += 1


# -- elementwise kernels and the sampler ------------------------------------------------------


@needs_kernel
def test_row_kernels_alone_equal_batched(threads):
    torch.manual_seed(threads)
    x, d = torch.randn(300, 1000), torch.randn(300, 1000)
    w = torch.randn(1000)
    total, normed = elementwise.add_rms_norm(x, d, w, 1e-6)
    logits = torch.randn(300, 4099) * 4
    ids, lse = sampling.argmax_logsumexp(logits)
    gate_up = torch.randn(300, 1400)
    act = elementwise.silu_mul(gate_up)
    for r in (0, 1, 17, 299):
        t1, n1 = elementwise.add_rms_norm(x[r : r + 1], d[r : r + 1], w, 1e-6)
        assert torch.equal(t1[0], total[r]) and torch.equal(n1[0], normed[r])
        assert torch.equal(elementwise.silu_mul(gate_up[r : r + 1])[0], act[r])
        i1, l1 = sampling.argmax_logsumexp(logits[r : r + 1])
        assert i1[0] == ids[r] and torch.equal(l1[0], lse[r])


def test_sampler_row_alone_equals_row_in_batch(threads):
    """Greedy and seeded rows (temperature, top-k, top-p, min-p, penalties) draw the same
    token with the same logprob alone and among 63 others, over a 49 152-token vocabulary (the
    size where torch's reductions split a single row across threads)."""
    rng = random.Random(threads)
    torch.manual_seed(threads)
    n, vocab = 64, 49152
    logits = torch.randn(n, vocab) * 3
    params = []
    for i in range(n):
        kind = i % 5
        params.append(
            SamplingParams()
            if kind == 0
            else SamplingParams(
                temperature=rng.choice((0.3, 0.7, 1.0, 1.5)),
                top_k=40 if kind == 2 else 0,
                top_p=0.9 if kind == 3 else 1.0,
                min_p=0.02 if kind == 4 else 0.0,
                repetition_penalty=1.2 if i % 7 == 0 else 1.0,
                seed=rng.randrange(1 << 30),
                num_logprobs=3,
            )
        )
    prompts = [[rng.randrange(vocab) for _ in range(20)] for _ in range(n)]
    outputs = [[rng.randrange(vocab) for _ in range(i % 9)] for i in range(n)]
    sampler = Sampler()
    out = sampler(logits, params, prompts, outputs)
    for i in range(n):
        one = sampler(logits[i : i + 1], [params[i]], [prompts[i]], [outputs[i]])
        assert int(one.token_ids[0]) == int(out.token_ids[i]), i
        assert torch.equal(one.logprobs[0], out.logprobs[i]), i
        if one.top_logprobs is not None:
            assert torch.equal(one.top_logprobs[0], out.top_logprobs[i, :3]), i


# -- torch ops the torch backend's deterministic path relies on ------------------------------


def test_torch_exp_lanes_agree(threads):
    """exp of a value is the same whether it lands in a vector lane or a loop tail, in a
    tensor of any size (torch's vector and scalar exp could differ in the last bit)."""
    torch.manual_seed(0)
    x = torch.randn(200_003) * 20
    full = torch.exp(x)
    for n in (1, 3, 7, 15, 17, 31, 33, 1000, 40_001):
        for off in range(0, 200_000 - n, 9973):
            assert torch.equal(torch.exp(x[off : off + n]), full[off : off + n]), (n, off)


def test_torch_cumsum_adds_in_order(threads):
    """cumsum's last element is the in-order sum of its line whatever the shape, the thread
    count or zeros appended; a plain sum is not (it splits a long row across threads)."""
    torch.manual_seed(1)
    x = torch.randn(64, 5000)
    full = x.cumsum(-1)[:, -1]
    padded = torch.cat([x, torch.zeros(64, 77)], dim=1).cumsum(-1)[:, -1]
    assert torch.equal(full, padded)
    for r in (0, 5, 63):
        assert torch.equal(x[r : r + 1].cumsum(-1)[0, -1], full[r])
        assert torch.equal(x[r].cumsum(0)[-1], full[r])
    line = x[0].double()
    acc = torch.zeros((), dtype=torch.float64)
    for v in line:  # the order itself: left to right, in double
        acc += v
    assert float(full[0]) == float(acc.float())
