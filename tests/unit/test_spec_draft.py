"""Speculative decoding with a draft model (executor_svc/features/spec/draft.py): the real scheduler
core against a real executor servicer whose runner loads a draft, on tiny Llama checkpoints.
The draft is the target itself (greedy proposals then always equal the target's argmax: every
one accepted, which needs the draft's own KV cache to be right at every position) or the target
cut to its first layer (partial acceptance). Outputs with speculation on equal outputs with it
off, token for token, greedy and seeded, through stops, preemption and prefix-cache hits.
"""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.features.spec.draft import draft_computed_after
from executor_svc.features.spec.view import SpecStep, spec_of
from executor_svc.runner.model_runner import ModelRunner
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.features.spec.decode import SpeculativeConfig, draft_executor_error
from tests.support.draft_models import truncate_checkpoint
from tests.support.model_factory import make_tiny_checkpoint
from tests.support.spec_driver import run_requests

pytestmark = pytest.mark.unit

K = 4


def _spec(k: int = K) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="draft_model", model="draft", num_speculative_tokens=k, disable_by_batch_size=0
    )


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_checkpoint(root / "target", num_hidden_layers=3)
    return {
        "target": target,
        "truncated": truncate_checkpoint(target, root / "truncated", 1),
        "other_vocab": make_tiny_checkpoint(root / "other", vocab_size=256),
    }


@pytest.fixture(scope="module")
def runners(dirs) -> dict[str, ModelRunner]:
    kw = dict(block_size=4, num_device_blocks=256)
    return {
        "off": ModelRunner(dirs["target"], **kw),
        "same": ModelRunner(dirs["target"], speculative_model=dirs["target"], **kw),
        "truncated": ModelRunner(dirs["target"], speculative_model=dirs["truncated"], **kw),
    }


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    motif = [rng.randrange(vocab) for _ in range(9)]
    return [motif * 3, [rng.randrange(vocab) for _ in range(23)], list(range(7, 20)) + [3]]


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
    "seeded": SamplingParams(temperature=0.9, seed=11, max_tokens=24),
    "seeded_topk_penalties": SamplingParams(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        seed=5,
        max_tokens=21,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("draft", ["same", "truncated"])
def test_draft_on_equals_off(runners: dict[str, ModelRunner], draft: str, name: str) -> None:
    params = PARAMS[name]
    reqs = [(p, params) for p in _prompts(runners["off"].info.vocab_size)]
    off = run_requests(runners["off"], reqs, None)
    on = run_requests(runners[draft], reqs, _spec())
    assert on.outputs == off.outputs
    if params.logprobs is not None:
        assert on.logprobs == off.logprobs  # bit for bit: the same rows, the same numerics
    assert on.proposed > 0
    if draft == "same" and name == "greedy":
        # The draft is the target: its greedy proposal is the target's argmax at every
        # position, so each is accepted (its KV, caught up in varlen prefills and one-position
        # steps of changing batches, must be the target's bits for that).
        assert on.accepted == on.proposed
        assert on.steps < off.steps / 2
    if draft == "truncated":
        assert on.accepted < on.proposed  # a different model: some rejected


def test_stops_and_max_tokens(runners: dict[str, ModelRunner]) -> None:
    prompts = _prompts(runners["off"].info.vocab_size, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    ref = run_requests(runners["off"], [(p, greedy) for p in prompts], None)
    stops = [ref.outputs[f"r{i}"][0][9] for i in range(len(prompts))]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stops),
        SamplingParams(temperature=1.0, seed=3, max_tokens=17, stop_token_ids=stops[:1]),
        SamplingParams(temperature=0.0, max_tokens=2),  # room for one proposal at most
        SamplingParams(temperature=0.0, max_tokens=1),  # never speculates
    ):
        reqs = [(p, params) for p in prompts]
        off = run_requests(runners["off"], reqs, None, eos_token_ids=(2,))
        for draft in ("same", "truncated"):
            on = run_requests(runners[draft], reqs, _spec(), eos_token_ids=(2,))
            assert on.outputs == off.outputs, (draft, params)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_cache(runners: dict[str, ModelRunner], mode: str) -> None:
    """Few blocks: decodes preempt each other; the shared motif hits the prefix cache, so a
    drafting sequence catches its draft up over blocks another sequence computed."""
    rng = random.Random(2)
    motif = [rng.randrange(500) for _ in range(16)]
    prompts = [motif + [rng.randrange(500) for _ in range(3)] for _ in range(6)]
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=40)
    reqs = [(p, params) for p in prompts]
    kw = dict(
        num_device_blocks=40, preemption_mode=mode, num_cpu_blocks=64 if mode == "swap" else 0
    )
    off = run_requests(runners["off"], reqs, None, **kw)
    for draft in ("same", "truncated"):
        on = run_requests(runners[draft], reqs, _spec(3), **kw)
        assert on.outputs == off.outputs, draft
        assert on.preemptions > 0 and on.accepted > 0
    greedy = [(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in prompts]
    on = run_requests(runners["same"], greedy, _spec(3), **kw)
    assert on.outputs == run_requests(runners["off"], greedy, None, **kw).outputs
    assert on.preemptions > 0 and on.accepted == on.proposed  # draft KV right after all that


def test_opt_out_and_n_greater_than_one(runners: dict[str, ModelRunner]) -> None:
    prompt = _prompts(runners["off"].info.vocab_size)[0]
    for p in (
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, n=2),
        SamplingParams(temperature=0.0, max_tokens=12, disable_speculation=True),
    ):
        off = run_requests(runners["off"], [(prompt, p)], None)
        on = run_requests(runners["same"], [(prompt, p)], _spec())
        assert on.outputs == off.outputs and on.proposed == 0


# ---------------------------------------------------------------------- pieces


def _draft_kv(runner: ModelRunner, seqs: list, seq_index: int, num_positions: int):
    """The draft's K and V of seqs[seq_index] at positions [0, num_positions), every layer."""
    kv = runner.features.handle("spec").kv_cache
    bs = runner.block_size
    table = seqs[seq_index].block_table
    slots = [table[p // bs] * bs + p % bs for p in range(num_positions)]
    out = []
    for k, v in kv.layers:
        out.append(k.flatten(0, 1)[slots].clone())
        out.append(v.flatten(0, 1)[slots].clone())
    return out


def test_draft_kv_is_the_same_bits_whatever_the_batch_and_split(
    runners: dict[str, ModelRunner],
) -> None:
    """A position's draft KV depends only on the tokens up to it: alone, beside another
    sequence, or caught up in two pieces, sequence A's draft cache holds the same bits (what
    makes rewriting a shared prefix block benign)."""
    from executor_svc.runner.model_runner import ScheduledSequence

    runner = runners["truncated"]
    rng = random.Random(5)
    a_tokens = [rng.randrange(500) for _ in range(21)]
    b_tokens = [rng.randrange(500) for _ in range(13)]

    def seq(sid: str, tokens: list[int], table: list[int], done: int = 0) -> ScheduledSequence:
        return ScheduledSequence(
            seq_id=sid, token_ids=tokens, num_prompt_tokens=len(tokens), block_table=table,
            num_computed_tokens=len(tokens) - 1, num_scheduled_tokens=1 + K,
            sampling_params=None,
            step_data={"spec": SpecStep(num_draft_tokens=K, draft_num_computed=done)},
        )  # fmt: skip

    a_table, b_table = list(range(10, 17)), list(range(30, 35))
    n = len(a_tokens)
    runner.features.handle("spec").kv_cache.key.zero_()
    alone = [seq("a", a_tokens, a_table)]
    runner.features.handle("spec").propose(alone, runner.prepare_inputs)
    ref = _draft_kv(runner, alone, 0, n)

    runner.features.handle("spec").kv_cache.key.fill_(7.0)  # stale bits everywhere
    batch = [seq("b", b_tokens, b_table), seq("a", a_tokens, a_table)]
    runner.features.handle("spec").propose(batch, runner.prepare_inputs)
    assert spec_of(batch[1]).spec_token_ids == spec_of(alone[0]).spec_token_ids
    for x, y in zip(_draft_kv(runner, batch, 1, n), ref, strict=True):
        assert torch.equal(x, y)

    runner.features.handle("spec").kv_cache.key.fill_(-3.0)
    first = [seq("a", a_tokens[:9], a_table)]
    runner.features.handle("spec").propose(
        first, runner.prepare_inputs
    )  # positions 0..8 (+ proposals)
    second = [seq("b", b_tokens, b_table), seq("a", a_tokens, a_table, done=9)]
    runner.features.handle("spec").propose(second, runner.prepare_inputs)  # catches up over 9..20
    assert spec_of(second[1]).spec_token_ids == spec_of(alone[0]).spec_token_ids
    for x, y in zip(_draft_kv(runner, second, 1, n), ref, strict=True):
        assert torch.equal(x, y)


def test_draft_computed_after() -> None:
    # 10 known tokens (p = 9), k = 4: the draft wrote t_p, d1, d2, d3 at positions 9..12.
    assert draft_computed_after(10, 4, 0) == 10  # only t_p's KV is right
    assert draft_computed_after(10, 4, 2) == 12  # d1, d2 kept
    assert draft_computed_after(10, 4, 4) == 13  # d4 was never fed to the draft
    assert draft_computed_after(10, 1, 1) == 10


def test_config_and_start_up_checks() -> None:
    c = SpeculativeConfig.from_json(
        '{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}'
    )
    assert c.uses_draft and c.model == "/m" and c.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="model"):
        SpeculativeConfig(method="ngram", model="/m")
    assert draft_executor_error(None, "", 0, 512) is None
    assert draft_executor_error(SpeculativeConfig(), "", 0, 512) is None  # n-gram needs none
    assert "no draft model" in draft_executor_error(c, "", 0, 512)
    assert "vocabulary" in draft_executor_error(c, "d", 256, 512)
    assert draft_executor_error(c, "d", 512, 512) is None


def test_runner_refuses_a_draft_of_another_vocabulary(dirs) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        ModelRunner(dirs["target"], block_size=4, num_device_blocks=8,
                    speculative_model=dirs["other_vocab"])  # fmt: skip


def test_describe_reports_the_draft(runners: dict[str, ModelRunner]) -> None:
    from executor_svc.api.service import ExecutorServicer
    from protos import executor_pb2 as epb

    d = ExecutorServicer(runners["truncated"]).Describe(epb.DescribeRequest(), None)
    assert (d.draft_model_name, d.draft_num_layers, d.draft_vocab_size) == ("truncated", 1, 512)
    d = ExecutorServicer(runners["off"]).Describe(epb.DescribeRequest(), None)
    assert d.draft_model_name == "" and d.draft_num_layers == 0


def test_executor_refuses_malformed_draft_requests(runners: dict[str, ModelRunner]) -> None:
    from executor_svc.api.service import ExecutorServicer
    from executor_svc.api.validation import InvalidStep
    from protos import executor_pb2 as epb

    for name, fields, match in (
        ("off", dict(num_scheduled_tokens=3, num_draft_tokens=2), "no draft model"),
        ("same", dict(num_scheduled_tokens=2, num_draft_tokens=2), "proposals"),
        ("same", dict(num_scheduled_tokens=3, num_draft_tokens=2, spec_token_ids=[5, 6]),
         "exclude"),
    ):  # fmt: skip
        servicer = ExecutorServicer(runners[name])
        new = epb.NewSequence(
            seq_id="s", token_ids=[1, 2, 3], num_prompt_tokens=3, block_table=[0, 1],
            num_computed_tokens=0, num_scheduled_tokens=3,
        )  # fmt: skip
        servicer._execute(epb.ExecuteModelRequest(step_id=1, new_sequences=[new]))
        c = epb.CachedSequence(seq_id="s", num_computed_tokens=3, **fields)
        with pytest.raises(InvalidStep, match=match):
            servicer._execute(epb.ExecuteModelRequest(step_id=2, cached_sequences=[c]))
        assert servicer._seqs["s"].num_computed_tokens == 3  # nothing applied
    # A well-formed one drafts, verifies and returns its proposals.
    c = epb.CachedSequence(seq_id="s", num_computed_tokens=3, num_scheduled_tokens=3,
                           num_draft_tokens=2)  # fmt: skip
    resp = servicer._execute(epb.ExecuteModelRequest(step_id=3, cached_sequences=[c]))
    (s,) = resp.sampled
    assert len(s.draft_token_ids) == 2 and len(s.spec_sampled) == 2
    assert s.draft_token_ids[0] == s.token_id  # the same model proposes the target's argmax


def test_launch_hands_the_draft_to_the_executor() -> None:
    from scheduler_svc.features.spec.flags import speculative_executor_args

    assert speculative_executor_args(None) == []
    assert speculative_executor_args('{"method": "ngram"}') == []
    draft = '{"method": "draft_model", "model": "/d"}'
    assert speculative_executor_args(draft) == ["--speculative-model", "/d"]
    with pytest.raises(SystemExit, match="model"):
        speculative_executor_args('{"method": "draft_model"}')


def test_executor_cli_refuses_a_draft_with_tensor_parallelism(capsys) -> None:
    from executor_svc.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--speculative-model", "/d", "--tensor-parallel-size", "2"])
    assert e.value.code == 2
    assert "--speculative-model does not run with --tensor-parallel-size" in capsys.readouterr().err


def test_scheduler_asks_the_draft_and_takes_its_proposals() -> None:
    """The core schedules 1 + k slots and num_draft_tokens = k, no proposal tokens; the reply's
    proposals are verified as n-gram ones are; a reply with the wrong count is refused."""
    from scheduler_svc.core.config import SchedulerConfig
    from scheduler_svc.core.request import Request
    from scheduler_svc.core.scheduler import Scheduler
    from scheduler_svc.engine.fleet.step_message import execute_request
    from scheduler_svc.features.spec.decode import lookahead, take_draft_proposals
    from scheduler_svc.features.spec.feature import add_proposals

    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=4, block_size=4, num_device_blocks=32,
            num_cpu_blocks=0, max_model_len=128, lookahead=lookahead(_spec(3)),
        )
    )  # fmt: skip
    sched.add_request(Request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=10), 0.0))
    out = sched.schedule()  # the prefill: never drafted
    assert not out.spec_token_ids
    (seq,) = sched.update_from_output(out, {out.new_seqs[0].seq_id: 40})
    out = sched.schedule()
    (c,) = out.cached_seqs
    assert (c.num_scheduled_tokens, c.num_draft_tokens, c.spec_token_ids) == (4, 3, [])
    msg = execute_request(out, out.step_id)
    add_proposals(msg, out)  # the feature's step_message hook
    (wire,) = msg.cached_sequences
    assert (wire.num_draft_tokens, list(wire.spec_token_ids)) == (3, [])
    with pytest.raises(ValueError, match="2 draft proposals"):
        take_draft_proposals(out, {seq.seq_id: [41, 42]})
    take_draft_proposals(out, {seq.seq_id: [41, 42, 9]})
    sched.update_from_output(out, {seq.seq_id: 41}, {seq.seq_id: [42, 43, 44]})
    assert seq.token_ids == [5, 6, 7, 8, 9, 40, 41, 42, 43]  # 41, 42 accepted, then the draw 43
    assert seq.num_computed_tokens == 8 and out.spec_num_accepted[seq.seq_id] == 2
    sched.check_invariants()
