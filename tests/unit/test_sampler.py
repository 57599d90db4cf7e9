"""Sampler specification: masks, penalties, seeding, distribution and logprobs."""

import math

import pytest
import torch

from executor_svc.kernels import library, sampling
from executor_svc.runner.noise import row_key, uniform_noise
from executor_svc.runner.sampler import (
    Sampler,
    SamplingParams,
    allowed_mask,
    apply_penalties,
)
from protos import executor_pb2 as pb

P = SamplingParams


def logits_from_probs(
    probs: list[float], order: list[int] | None = None, vocab: int | None = None
) -> torch.Tensor:
    """[1, vocab] logits whose softmax is probs at token ids `order`; other ids are -inf."""
    ids = order if order is not None else list(range(len(probs)))
    row = torch.full((vocab or len(probs),), float("-inf"), dtype=torch.float64)
    row[ids] = torch.tensor(probs, dtype=torch.float64).log()
    return row.float()[None, :]


def kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    return set(allowed_mask(logits, [params])[0].nonzero().flatten().tolist())


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
):
    n = logits.shape[0]
    return Sampler()(logits, params, prompts or [[] for _ in range(n)], outputs or [[]] * n)


def reference_top_p(logits: torch.Tensor, top_p: float) -> set[int]:
    """Oracle: full float64 sort by (prob desc, id asc), keep while mass before < top_p."""
    probs = torch.softmax(logits.double(), dim=-1)
    order = sorted(range(len(probs)), key=lambda i: (-probs[i].item(), i))
    keep, mass = set(), 0.0
    for i in order:
        if keep and mass >= top_p - 1e-6:
            break
        keep.add(i)
        mass += probs[i].item()
    return keep


# --- proto conversion and noise -------------------------------------------------------------


def test_from_proto_reads_zeros_as_disabled():
    p = SamplingParams.from_proto(pb.SamplingParams())
    assert p == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    assert p.seed is None
    p = SamplingParams.from_proto(
        pb.SamplingParams(
            temperature=0.5, top_k=-1, top_p=0.5, min_p=0.25, repetition_penalty=1.5, seed=0
        )
    )
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty, p.seed) == (
        0.5,
        0,
        0.5,
        0.25,
        1.5,
        0,  # seed 0 is set, not absent
    )
    assert SamplingParams.from_proto(pb.SamplingParams(seed=2**64 - 1, top_k=7)).seed == 2**64 - 1


def _fmix_reference(key: tuple[int, int], token: int) -> float:
    m = 0xFFFFFFFF
    z = (token * 0x9E3779B9 + key[0]) & m
    z ^= z >> 16
    z = (z * 0x85EBCA6B) & m
    z ^= key[1] & m
    z ^= z >> 13
    z = (z * 0xC2B2AE35) & m
    z ^= z >> 16
    top = z >> 9  # 23 bits; the kernel reads them signed, offset back into [0, 2^23)
    signed = top - 2**23 if top >= 2**22 else top
    return (signed + 2**22 + 0.5) / 2**23


def test_noise_matches_unsigned_reference_despite_signed_int32_wraparound():
    keys = [row_key(seed, pos) for seed, pos in [(0, 0), (2**64 - 1, 5), (123, 10**6)]]
    ids = torch.tensor([0, 1, 2, 77, 49151, 2**20])
    u = uniform_noise(torch.tensor(keys, dtype=torch.int32), ids)
    expected = [[_fmix_reference(k, t) for t in ids.tolist()] for k in keys]
    assert u.dtype == torch.float32
    assert u.double().tolist() == expected
    assert bool(((u > 0) & (u < 1)).all())


# --- masks ----------------------------------------------------------------------------------


def test_top_k_keeps_exactly_k_most_likely():
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0))
    params = [P(temperature=1.0, top_k=k) for k in (1, 7, 40)]
    mask = allowed_mask(logits, params)
    for row, k in enumerate((1, 7, 40)):
        assert int(mask[row].sum()) == k
        assert set(mask[row].nonzero().flatten().tolist()) == set(
            logits[row].topk(k).indices.tolist()
        )


def test_top_k_ties_keep_lowest_ids_whatever_the_batch():
    # Token 4 is best, then ids 2, 5, 8, 9 tie: top_k=3 keeps 4 and the two lowest tied ids.
    row = torch.tensor([[0.0, 0.0, 2.0, 0.0, 3.0, 2.0, 0.0, 0.0, 2.0, 2.0]])
    assert kept(row, P(temperature=1.0, top_k=3)) == {4, 2, 5}
    # A wider top-k row changes the candidate width; the tied row keeps the same set.
    batch = torch.cat([row.repeat(1, 1), row.flip(-1)])
    mask = allowed_mask(batch, [P(temperature=1.0, top_k=3), P(temperature=1.0, top_k=9)])
    assert set(mask[0].nonzero().flatten().tolist()) == {4, 2, 5}
    assert int(mask[1].sum()) == 9


def test_top_p_hand_built_distribution():
    # Tokens 3, 0, 2, 1 have probs 1/2, 1/4, 1/8, 1/8.
    logits = logits_from_probs([0.5, 0.25, 0.125, 0.125], order=[3, 0, 2, 1])
    assert kept(logits, P(temperature=1.0, top_p=0.75)) == {3, 0}  # mass reaches 0.75 exactly
    assert kept(logits, P(temperature=1.0, top_p=0.76)) == {3, 0, 1}  # tie 2 vs 1: lower id
    assert kept(logits, P(temperature=1.0, top_p=0.5)) == {3}
    assert kept(logits, P(temperature=1.0, top_p=0.1)) == {3}
    assert kept(logits, P(temperature=1.0, top_p=1e-7)) == {3}  # top token always kept
    assert kept(logits, P(temperature=1.0, top_p=0.0)) == {3}
    assert kept(logits, P(temperature=1.0, top_p=1.0)) == {0, 1, 2, 3}


def test_top_p_ties_and_boundary():
    # 0.4 then three tokens tied at 0.2 (ids 5, 1, 3).
    logits = logits_from_probs([0.4, 0.2, 0.2, 0.2], order=[0, 5, 1, 3], vocab=6)
    assert kept(logits, P(temperature=1.0, top_p=0.4)) == {0}  # 0.4 reaches 0.4 exactly
    assert kept(logits, P(temperature=1.0, top_p=0.5)) == {0, 1}
    assert kept(logits, P(temperature=1.0, top_p=0.6)) == {0, 1}
    assert kept(logits, P(temperature=1.0, top_p=0.61)) == {0, 1, 3}


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1])
    # Over top-3, probs are 4/9, 3/9, 2/9: mass before token 2 is 7/9 > 0.75.
    assert kept(logits, P(temperature=1.0, top_k=3, top_p=0.75)) == {0, 1}
    assert kept(logits, P(temperature=1.0, top_p=0.75)) == {0, 1, 2}


def test_top_p_after_temperature():
    logits = logits_from_probs([0.6, 0.3, 0.1])
    assert kept(logits, P(temperature=1.0, top_p=0.6)) == {0}
    # T = 2 flattens to ~ [0.47, 0.33, 0.19]: the nucleus needs two tokens.
    assert kept(logits, P(temperature=2.0, top_p=0.6)) == {0, 1}


@pytest.mark.parametrize("quantise", [False, True])
def test_wide_nucleus_matches_full_sort_oracle(quantise):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 5000, generator=gen) * 2
    if quantise:  # bf16-like ties everywhere, including at the nucleus edge
        logits = (logits * 4).round() / 4
    top_ps = [0.3, 0.5, 0.8, 0.9, 0.95, 0.999]
    mask = allowed_mask(logits, [P(temperature=1.0, top_p=p) for p in top_ps])
    for row, top_p in enumerate(top_ps):
        assert set(mask[row].nonzero().flatten().tolist()) == reference_top_p(logits[row], top_p)


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05], order=[2, 0, 3, 1])
    assert kept(logits, P(temperature=1.0, min_p=0.2)) == {2, 0, 3}  # 0.05 < 0.1 <= 0.15
    assert kept(logits, P(temperature=1.0, min_p=0.5)) == {2, 0}
    # Same rule on the candidate path, and min_p = 1 keeps only the top token.
    assert kept(logits, P(temperature=1.0, min_p=0.2, top_k=4)) == {2, 0, 3}
    assert kept(logits, P(temperature=1.0, min_p=1.0)) == {2}
    # After temperature 0.5 the probs are ~ [0.70, 0.25, 0.06, 0.007]: 0.06 < 0.2 * 0.70.
    assert kept(logits, P(temperature=0.5, min_p=0.2)) == {2, 0}


# --- penalties and greedy -------------------------------------------------------------------


def test_penalty_formulas_against_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    before = logits.clone()
    params = [
        P(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        P(),
    ]
    out = apply_penalties(logits, params, [[0, 1], [0, 1]], [[3, 3, 1], [3, 3, 1]])
    # Repetition over {0, 1, 3}: 2/2, -1*2, 3/2; then output counts {3: 2, 1: 1}:
    # token 3: 1.5 - 0.5*2 - 0.25, token 1: -2 - 0.5*1 - 0.25. Token 0 is prompt only.
    assert out[0].tolist() == pytest.approx([1.0, -2.75, 0.5, 0.25, -2.0])
    assert torch.equal(out[1], before[1])
    assert torch.equal(logits, before)  # input untouched


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    out = apply_penalties(logits, [P(frequency_penalty=1.0, presence_penalty=1.0)], [[0, 0]], [[]])
    assert out.tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_greedy_is_argmax_of_penalised_logits():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2))
    out = sample(logits, [P()] * 5)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    # A repetition penalty on the argmax token moves greedy to the runner-up.
    top2 = logits[0].topk(2).indices.tolist()
    logits[0, top2[0]] = 10.0
    logits[0, top2[1]] = 9.0
    out = sample(logits[:1], [P(repetition_penalty=2.0)], prompts=[[top2[0]]])
    assert out.token_ids.tolist() == [top2[1]]


def test_temperature_zero_ignores_seed():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(3)).repeat(6, 1)
    params = [P(temperature=0.0, seed=s, top_k=5, top_p=0.5) for s in range(5)] + [P()]
    out = sample(logits, params, outputs=[[1] * i for i in range(6)])
    assert out.token_ids.tolist() == [int(logits[0].argmax())] * 6


# --- seeded randomness ----------------------------------------------------------------------


def _probe_rows():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 2000, generator=gen) * 2 * 4).round() / 4  # ties on purpose
    params = [
        P(temperature=0.9, seed=42),  # full vocabulary race
        P(temperature=0.8, seed=7, top_k=20, min_p=0.01),  # top-k candidates
        P(temperature=1.1, seed=2**63 + 5, top_p=0.9),  # histogram-sized nucleus
    ]
    outputs = [[1] * 7, [2] * 3, []]
    return logits, params, outputs


@pytest.mark.parametrize("probe", [0, 1, 2])
def test_seeded_row_is_independent_of_batch_composition(probe):
    logits, params, outputs = _probe_rows()
    alone = sample(logits[probe : probe + 1], [params[probe]], [outputs[probe]]).token_ids.item()
    gen = torch.Generator().manual_seed(5)
    for num_others, insert_at in [(1, 0), (5, 3), (40, 17)]:
        others = torch.randn(num_others, 2000, generator=gen) * 3
        kinds = [
            P(),
            P(temperature=1.0),
            P(temperature=1.0, top_k=700),
            P(temperature=1.0, top_p=0.99),
        ]
        batch_params = [kinds[i % 4] for i in range(num_others)]
        batch_logits = list(others)
        batch_outputs = [[9] * i for i in range(num_others)]
        batch_logits.insert(insert_at, logits[probe])
        batch_params.insert(insert_at, params[probe])
        # Same position, different content: only the output length matters without penalties.
        batch_outputs.insert(insert_at, [3] * len(outputs[probe]))
        out = sample(torch.stack(batch_logits), batch_params, batch_outputs)
        assert out.token_ids[insert_at].item() == alone


def test_different_seeds_and_positions_draw_differently():
    logits = torch.zeros(64, 1000)
    by_seed = sample(logits, [P(temperature=1.0, seed=s) for s in range(64)]).token_ids
    by_pos = sample(
        logits, [P(temperature=1.0, seed=1)] * 64, outputs=[[0] * i for i in range(64)]
    ).token_ids
    assert len(set(by_seed.tolist())) > 55
    assert len(set(by_pos.tolist())) > 55
    # Draws for one seed follow the output position, not the row index.
    shuffled = sample(
        logits[:8], [P(temperature=1.0, seed=1)] * 8, outputs=[[0] * i for i in range(7, -1, -1)]
    ).token_ids
    assert shuffled.tolist() == by_pos[:8].flip(0).tolist()


def _draws(logits_row: torch.Tensor, params: SamplingParams, num_seeds=200, num_pos=100):
    zeros = [[0] * i for i in range(num_pos)]  # shared lists: outputs only need a length
    n = num_seeds * num_pos
    logits = logits_row.expand(n, -1)
    rows = [
        P(**{**{f: getattr(params, f) for f in params.__slots__}, "seed": s})
        for s in range(num_seeds)
    ]
    out = Sampler()(logits, [r for r in rows for _ in range(num_pos)], [[]] * n, zeros * num_seeds)
    return torch.bincount(out.token_ids, minlength=logits_row.shape[-1]).double()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    nz = expected > 0
    assert counts[~nz].sum() == 0, "sampled a token with zero probability"
    return float(((counts[nz] - expected[nz]) ** 2 / expected[nz]).sum())


def test_temperature_one_follows_softmax():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0, 0.2])
    counts = _draws(logits, P(temperature=1.0))
    assert _chi_square(counts, torch.softmax(logits.double(), -1)) < 24.32  # df 7, p = 0.001


def test_truncated_sampling_follows_renormalised_distribution():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, -3.0, 0.2])
    counts = _draws(logits, P(temperature=0.7, top_k=4))
    probs = torch.softmax(logits.double() / 0.7, -1)
    probs[probs < probs.topk(4).values[-1]] = 0
    assert _chi_square(counts, probs / probs.sum()) < 16.27  # df 3, p = 0.001


# --- logprobs and mixed batches -------------------------------------------------------------


def test_logprobs_come_from_raw_distribution_and_top_n_is_ordered():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(6)) * 3
    params = [
        P(),
        P(temperature=0.5, top_k=3, num_logprobs=2, repetition_penalty=1.8),
        P(temperature=2.0, seed=1, num_logprobs=5),
        P(temperature=1.0, top_p=0.5, frequency_penalty=1.0),
    ]
    out = sample(logits, params, outputs=[[1, 2]] * 4, prompts=[[3]] * 4)
    raw = torch.log_softmax(logits, dim=-1)
    expected = raw.gather(-1, out.token_ids[:, None]).squeeze(-1)
    assert torch.allclose(out.logprobs, expected, atol=1e-5)
    assert out.logprobs.dtype == torch.float32
    assert out.top_token_ids.shape == out.top_logprobs.shape == (4, 5)
    assert torch.equal(out.top_token_ids, raw.topk(5).indices)
    assert torch.allclose(out.top_logprobs, raw.topk(5).values, atol=1e-5)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    assert sample(logits, [P()] * 4).top_token_ids is None


def test_mixed_batch_of_greedy_seeded_and_unseeded_rows():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(8))
    params = [
        P(),
        P(temperature=1.0, seed=11),
        P(temperature=1.0),
        P(temperature=0.7, top_k=10),
        P(temperature=1.0, seed=12, top_p=0.9),
        P(temperature=1.0, top_p=0.8, min_p=0.05),
    ]
    first = sample(logits, params)
    second = sample(logits, params)
    assert first.token_ids[0].item() == int(logits[0].argmax())
    assert first.token_ids[1] == second.token_ids[1]
    assert first.token_ids[4] == second.token_ids[4]
    assert first.token_ids[1].item() == sample(logits[1:2], [params[1]]).token_ids.item()
    assert int(first.token_ids[3]) in set(logits[3].topk(10).indices.tolist())
    # Unseeded rows draw fresh randomness each call; 20 calls all agreeing would be a bug.
    draws = {tuple(sample(logits, params).token_ids[[2, 5]].tolist()) for _ in range(20)}
    assert len(draws) > 1
    allowed = allowed_mask(logits, params)
    for out in (first, second):
        assert bool(allowed[torch.arange(6), out.token_ids].all())


def test_sampler_leaves_input_logits_untouched():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    params = [
        P(temperature=0.5, min_p=0.1),
        P(temperature=2.0, top_p=0.9),
        P(repetition_penalty=1.5),
    ]
    sample(logits, params, prompts=[[1, 2]] * 3)
    sample(logits, [P(temperature=0.5)] * 3)
    assert torch.equal(logits, before)


# --- min_tokens -----------------------------------------------------------------------------

EOS, STOP = 5, 7


def test_from_proto_joins_eos_to_min_tokens_ids_only_when_min_tokens_is_set():
    pb_params = pb.SamplingParams(min_tokens=3, min_tokens_suppressed_ids=[STOP, EOS])
    p = SamplingParams.from_proto(pb_params, eos_token_ids=[EOS, 2])
    assert (p.min_tokens, p.min_tokens_masked_ids) == (3, (2, EOS, STOP))
    off = SamplingParams.from_proto(pb.SamplingParams(min_tokens_suppressed_ids=[STOP]), [EOS])
    assert (off.min_tokens, off.min_tokens_masked_ids) == (0, ())
    # Nothing to mask (no EOS, no stop ids): the row never pays for the mask.
    assert SamplingParams.from_proto(pb.SamplingParams(min_tokens=3)).min_tokens == 0


def test_min_tokens_masks_eos_and_stop_ids_until_enough_outputs():
    # EOS is every row's argmax and STOP the runner-up; token 1 comes third.
    row = torch.full((10,), -1.0)
    row[EOS], row[STOP], row[1] = 5.0, 4.0, 3.0
    logits = row.repeat(3, 1)
    before = logits.clone()
    params = [
        P(min_tokens=3, min_tokens_masked_ids=(EOS, STOP)),
        P(),  # same batch, no min_tokens: unaffected
        P(temperature=1.0, top_k=2, seed=3, min_tokens=3, min_tokens_masked_ids=(EOS, STOP)),
    ]
    for num_outputs in range(5):
        out = sample(logits, params, outputs=[[0] * num_outputs] * 3).token_ids.tolist()
        if num_outputs < 3:
            # Greedy skips both masked ids; top-k=2 keeps the best two unmasked ones.
            assert out[0] == 1 and out[2] not in (EOS, STOP)
        else:
            assert out[0] == EOS
        assert out[1] == EOS
    # The mask never writes into the caller's logits.
    assert torch.equal(logits, before)


def test_min_tokens_mask_composes_with_penalties():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, 0.0, 4.0]])
    params = [P(repetition_penalty=2.0, min_tokens=2, min_tokens_masked_ids=(EOS,))]
    # Token 1 is in the output, so its 3.0 halves to 1.5 and token 2 (2.0) wins once EOS is out.
    out = sample(logits, params, outputs=[[1]], prompts=[[0]])
    assert out.token_ids.tolist() == [2]
    assert sample(logits, params, outputs=[[1, 1]], prompts=[[0]]).token_ids.tolist() == [EOS]


def test_logit_bias_moves_only_its_rows_and_keeps_raw_logprobs():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]]).repeat(3, 1)
    before = logits.clone()
    params = [
        P(logit_bias_ids=(2,), logit_bias_values=(2.5,)),  # 1 + 2.5 beats 3
        P(),  # same batch, no bias
        P(logit_bias_ids=(0, 3), logit_bias_values=(-100.0, 1.5)),  # ban the argmax
    ]
    out = sample(logits, params, outputs=[[]] * 3)
    assert out.token_ids.tolist() == [2, 0, 1]
    # Logprobs are those of the raw model distribution, bias or not; the input is untouched.
    raw = torch.log_softmax(before, dim=-1)
    assert torch.allclose(out.logprobs, raw[[0, 1, 2], [2, 0, 1]])
    assert torch.equal(logits, before)


def test_logit_bias_in_sampled_rows_bans_tokens():
    logits = torch.zeros(1, 8).repeat(64, 1)  # uniform: every token equally likely
    banned = (0, 1, 2, 3, 4, 5)
    params = [
        P(temperature=1.0, seed=s, logit_bias_ids=banned, logit_bias_values=(-100.0,) * 6)
        for s in range(64)
    ]
    drawn = set(sample(logits, params, outputs=[[]] * 64).token_ids.tolist())
    assert drawn == {6, 7}


@pytest.mark.skipif(not library.available(), reason="no C++ compiler here")
def test_compiled_argmax_and_logsumexp_match_torch():
    """The CPU library's one-pass reductions, which the greedy path and every logprob use:
    ties go to the first index as with torch.argmax, odd widths and strided rows work, and the
    sampler's greedy tokens and logprobs equal torch's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 49157, generator=g)[:, 2:]  # width not a multiple of 16, row stride != width
    x[1, 100] = x[1, 20_000] = 50.0  # a tie: the first one
    x[2, -1] = 60.0  # the maximum in the scalar tail
    x[3] = 1.0  # all equal
    x[4, 5] = x[4, 21] = 70.0  # a tie within the first 16-wide step's lanes
    ids, lse = sampling.argmax_logsumexp(x)
    assert ids.tolist() == x.argmax(-1).tolist()
    torch.testing.assert_close(lse, torch.logsumexp(x, -1), atol=1e-5, rtol=1e-6)
    out = sample(x, [P()] * 9, outputs=[[]] * 9)
    assert out.token_ids.tolist() == x.argmax(-1).tolist()
    ref = x.gather(-1, x.argmax(-1, keepdim=True)).squeeze(-1) - torch.logsumexp(x, -1)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=1e-6)
    assert sampling.argmax_logsumexp(x.double()) is None  # left to torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    logits, params, outputs = _probe_rows()
    keys = torch.tensor([row_key(3, 4), row_key(5, 6)], dtype=torch.int32)
    ids = torch.arange(4096)
    assert torch.equal(uniform_noise(keys.cuda(), ids.cuda()).cpu(), uniform_noise(keys, ids))
    cpu = sample(logits, params, outputs)
    gpu = sample(logits.cuda(), params, outputs)
    assert gpu.token_ids.device.type == "cuda"
    assert gpu.token_ids.cpu().tolist() == cpu.token_ids.tolist()
    assert math.isclose(float(gpu.logprobs.sum()), float(cpu.logprobs.sum()), rel_tol=1e-4)
