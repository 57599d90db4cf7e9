"""Speculative decoding changes how many tokens a step yields, never which tokens.

The real scheduler core against a real executor servicer (tests/support/spec_driver.py): the
same requests with speculation off and on must give the same tokens, greedy and seeded, with
penalties, logprobs, stop tokens, max_tokens and preemption. A random tiny model rarely repeats
itself, so besides the n-gram proposer an oracle proposer (the reference continuation, corrupted
at random positions) forces every acceptance pattern: all accepted, none, a prefix.
"""

from __future__ import annotations

import random

import pytest

from executor_svc.runner.model_runner import ModelRunner
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.features.spec.decode import SpeculativeConfig, accept, propose_ngram
from tests.support.model_factory import make_tiny_checkpoint
from tests.support.spec_driver import oracle, run_requests, with_proposer

pytestmark = pytest.mark.unit

SPEC = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=0)


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "tiny")
    return ModelRunner(model_dir, block_size=4, num_device_blocks=256)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    motif = [rng.randrange(vocab) for _ in range(9)]
    return [
        motif * 4,  # the n-gram proposer finds matches at once
        [rng.randrange(vocab) for _ in range(23)],  # and here mostly none
        list(range(7, 20)) * 2 + [3],
    ]


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24),
    "seeded": SamplingParams(temperature=0.9, seed=11, max_tokens=24),
    "seeded_topk_penalties": SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        seed=5,
        max_tokens=24,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    ),
    "min_tokens_logit_bias": SamplingParams(
        temperature=0.0, max_tokens=24, min_tokens=10, logit_bias={5: 3.0, 9: -2.0}
    ),
}


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("rate", [0.0, 0.3, 1.0])
def test_oracle_proposals_change_nothing(runner: ModelRunner, name: str, rate: float) -> None:
    prompts = _prompts(runner.info.vocab_size)
    reqs = [(p, PARAMS[name]) for p in prompts]
    off = run_requests(runner, reqs, None)
    on = with_proposer(lambda: run_requests(runner, reqs, SPEC), oracle(off, prompts, rate, seed=3))
    assert on.outputs == off.outputs
    assert on.proposed > 0
    if rate == 0.0:
        # Everything accepted: about 1 + k tokens a step.
        assert on.accepted == on.proposed
        assert on.steps < off.steps / 2
    if rate == 1.0:
        assert on.accepted == 0


def test_ngram_on_equals_off_with_stops_and_logprobs(runner: ModelRunner) -> None:
    prompts = _prompts(runner.info.vocab_size, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, logprobs=2)
    off = run_requests(runner, [(p, greedy) for p in prompts], None)
    # Stop on a token met in the middle of each reference output.
    stops = [off.outputs[f"r{i}"][0][12] for i in range(len(prompts))]
    ngram_proposed = 0
    for params in (
        greedy,
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stops),
        SamplingParams(temperature=1.0, seed=3, max_tokens=17, stop_token_ids=stops[:1]),
    ):
        reqs = [(p, params) for p in prompts]
        a = run_requests(runner, reqs, None)
        b = with_proposer(
            lambda reqs=reqs: run_requests(runner, reqs, SPEC), oracle(a, prompts, 0.2, 1)
        )
        c = run_requests(runner, reqs, SPEC)  # the n-gram proposer itself
        assert a.outputs == b.outputs == c.outputs
        assert b.proposed > 0
        ngram_proposed += c.proposed
        if params.logprobs is not None:
            assert a.logprobs == b.logprobs  # bit for bit: the same rows, the same numerics
    assert ngram_proposed > 0


def test_preemption_and_prefix_cache(runner: ModelRunner) -> None:
    """Few blocks: decodes preempt each other (recompute and swap); the shared motif prompt
    hits the prefix cache. Outputs equal, no block leaked (the driver checks every step)."""
    rng = random.Random(2)
    motif = [rng.randrange(500) for _ in range(16)]
    prompts = [motif + [rng.randrange(500) for _ in range(3)] for _ in range(6)]
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=40)
    reqs = [(p, params) for p in prompts]
    for mode, cpu in (("recompute", 0), ("swap", 64)):
        kw = dict(num_device_blocks=40, preemption_mode=mode, num_cpu_blocks=cpu)
        off = run_requests(runner, reqs, None, **kw)
        on = with_proposer(
            lambda kw=kw: run_requests(runner, reqs, SPEC, **kw), oracle(off, prompts, 0.1, 4)
        )
        assert on.outputs == off.outputs
        assert off.preemptions > 0 and on.preemptions > 0
        assert on.accepted > 0


def test_n_greater_than_one_and_opt_out_do_not_speculate(runner: ModelRunner) -> None:
    prompts = _prompts(runner.info.vocab_size)
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, n=2),
        SamplingParams(temperature=0.0, max_tokens=12, disable_speculation=True),
    ]
    for p in params:
        reqs = [(prompts[0], p)]
        off = run_requests(runner, reqs, None)
        on = run_requests(runner, reqs, SPEC)
        assert on.outputs == off.outputs
        assert on.proposed == 0


# ---------------------------------------------------------------------- pieces


def test_propose_ngram() -> None:
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 4) == [4, 5, 1]
    assert propose_ngram([1, 2, 3], 3, 1, 4) == []
    # The longest suffix wins over a later, shorter match.
    assert propose_ngram([7, 8, 9, 1, 8, 2, 7, 8], 2, 1, 2) == [9, 1]
    assert propose_ngram([7, 8, 9, 1, 8, 2, 7, 8], 2, 1, 1) == [2, 7]
    assert propose_ngram([4, 4, 4], 5, 2, 3) == [4]


def test_accept() -> None:
    assert accept([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept([1, 2, 3], [1, 5, 3, 4]) == 1
    assert accept([1, 2, 3], [0, 2, 3, 4]) == 0


def test_config_json() -> None:
    c = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'
    )
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 1, 5)
    for bad in ('{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"k": 1}', "[1]", "x"):
        with pytest.raises(ValueError):
            SpeculativeConfig.from_json(bad)


def test_disable_by_batch_size(runner: ModelRunner) -> None:
    """Above the limit nothing is proposed; once few enough requests run, proposals resume."""
    prompts = _prompts(runner.info.vocab_size)
    reqs = [
        (p, SamplingParams(temperature=0.0, max_tokens=6 + 10 * i)) for i, p in enumerate(prompts)
    ]
    off = run_requests(runner, reqs, None)
    proposer = oracle(off, prompts, 0.0, seed=0)
    many = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=1)
    alone = with_proposer(lambda: run_requests(runner, reqs[:1], many), proposer)
    assert alone.proposed > 0
    together = with_proposer(lambda: run_requests(runner, reqs, many), proposer)
    assert together.outputs == off.outputs
    # Only the last request, once the other two ended, speculated.
    assert 0 < together.proposed <= 26 - 16


def test_executor_refuses_malformed_proposals(runner: ModelRunner) -> None:
    from executor_svc.api.service import ExecutorServicer
    from executor_svc.api.validation import InvalidStep
    from protos import executor_pb2 as epb

    servicer = ExecutorServicer(runner)
    new = epb.NewSequence(
        seq_id="s", token_ids=[1, 2, 3], num_prompt_tokens=3, block_table=[0, 1],
        num_computed_tokens=0, num_scheduled_tokens=3,
    )  # fmt: skip
    servicer._execute(epb.ExecuteModelRequest(step_id=1, new_sequences=[new]))
    bad = {
        "num_scheduled_tokens": dict(num_scheduled_tokens=2, spec_token_ids=[5, 6]),
        "past the vocabulary": dict(num_scheduled_tokens=2, spec_token_ids=[100000]),
        "block table": dict(num_scheduled_tokens=6, spec_token_ids=[5, 6, 7, 8, 9]),
    }
    for what, fields in bad.items():
        c = epb.CachedSequence(seq_id="s", num_computed_tokens=3, **fields)
        with pytest.raises(InvalidStep, match="spec_token_ids|block table"):
            servicer._execute(epb.ExecuteModelRequest(step_id=2, cached_sequences=[c]))
        assert servicer._seqs["s"].num_computed_tokens == 3, what  # nothing applied
    # A well-formed one verifies and keeps the executor's state consistent.
    c = epb.CachedSequence(seq_id="s", num_computed_tokens=3, num_scheduled_tokens=3,
                           spec_token_ids=[5, 6])  # fmt: skip
    resp = servicer._execute(epb.ExecuteModelRequest(step_id=3, cached_sequences=[c]))
    assert len(resp.sampled) == 1 and len(resp.sampled[0].spec_sampled) == 2


def test_rejected_proposals_back_off() -> None:
    """A sequence whose every proposal is rejected verifies 7 times in 128 steps (two misses
    free while its hit rate, with a prior of one hit in two, is >= 1/4; then pauses of 1, 4, 16,
    64 after each miss) and once every 65 steps after that; an accepted proposal ends the pause,
    and a sequence that hits often enough keeps proposing through its misses."""
    from scheduler_svc.core.request import Request
    from scheduler_svc.features.spec.decode import SpecDecoder

    dec = SpecDecoder(SPEC)
    dec.proposer = lambda tokens, k: [1] * k  # always proposes (and here always "misses")
    req = Request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=10_000), 0.0)
    seq = req.seqs[0]
    verifying = []
    for step in range(300):
        if dec.propose(req, seq, max_len=100_000, budget=64):
            verifying.append(step)
            dec._adapt(seq.seq_id, 0)
    assert verifying[:8] == [0, 1, 2, 4, 9, 26, 91, 156]
    assert sum(s < 128 for s in verifying) == 7
    assert all(b - a == 65 for a, b in zip(verifying[6:], verifying[7:], strict=False))
    dec._adapt(seq.seq_id, 2)
    assert dec._backoff[seq.seq_id].pause == 0
    dec._backoff[seq.seq_id].skip = 0
    dec._adapt(seq.seq_id, 0)  # a miss after a hit pauses one step again
    assert dec._backoff[seq.seq_id].skip == 1
    # A sequence whose verifications hit half the time never pauses.
    req2 = Request("r2", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=10_000), 0.0)
    seq2 = req2.seqs[0]
    for step in range(100):
        assert dec.propose(req2, seq2, max_len=100_000, budget=64), step
        dec._adapt(seq2.seq_id, step % 2)
