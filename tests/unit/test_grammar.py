"""Structured outputs in the scheduler: mask rows on the wire, the grammar cache, and matcher
replay (a matcher rebuilt from a sequence's stored outputs gives the masks of the one that
followed it token by token)."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from executor_svc.features.structured.token_mask import decode_masks, unpack_rows
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams, ValidationError
from scheduler_svc.core.scheduler_output import SchedulerOutput
from scheduler_svc.features.structured.bitmask import (
    allowed_ids,
    decode_rows,
    encode_rows,
    pack_ids,
)
from scheduler_svc.features.structured.compiler import GrammarCompiler
from scheduler_svc.features.structured.matchers import SeqMatchers

VOCAB = 512
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory) -> GrammarCompiler:
    from executor_svc.demo.demo_model import ensure_demo_model

    model_dir = ensure_demo_model(Path(tmp_path_factory.mktemp("m")), size="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return GrammarCompiler(tok, VOCAB, [tok.eos_token_id], cache_size=4)


ROWS = [[0], [31, 32, 33], [511], list(range(0, 512, 7)), [5, 500], [31, 32, 33]]


def test_rows_round_trip_and_repeat_rows_are_sent_once() -> None:
    rows = np.stack([pack_ids(ids, VOCAB) for ids in ROWS])
    assert rows.shape == (len(ROWS), VOCAB // 32)
    index, payload = encode_rows(rows)
    assert index == [0, 1, 2, 3, 4, 1]
    distinct = decode_rows(payload, VOCAB)
    assert [allowed_ids(distinct[i], VOCAB) for i in index] == ROWS
    # The executor's reading of the same bytes allows exactly these tokens.
    seq_ids = [f"s{i}" for i in range(len(ROWS))]
    by_seq = decode_masks(seq_ids, index, payload, VOCAB)
    allowed = unpack_rows([by_seq[s] for s in seq_ids], VOCAB)
    assert [np.flatnonzero(a).tolist() for a in allowed] == ROWS


def test_bit_layout_is_little_endian_words() -> None:
    words = pack_ids([0, 33], 64)
    assert words.tolist() == [1, 2]  # token 33 is bit 1 of word 1


def test_malformed_rows_are_refused() -> None:
    _, payload = encode_rows(np.stack([pack_ids([1], VOCAB)]))
    with pytest.raises(ValueError, match="whole"):
        decode_rows(zlib.compress(b"\xff" * 8), VOCAB)
    with pytest.raises(ValueError, match="no token"):
        decode_masks(["a"], [0], zlib.compress(bytes(VOCAB // 8)), VOCAB)
    with pytest.raises(ValueError, match="past"):
        decode_masks(["a"], [1], payload, VOCAB)
    with pytest.raises(ValueError, match="zlib"):
        decode_masks(["a"], [0], b"junk", VOCAB)


def test_cache_is_bounded_and_keyed_by_spec(compiler: GrammarCompiler) -> None:
    before = compiler.num_compiled
    specs = [{"regex": f"a{{{i}}}"} for i in range(1, 7)]
    for spec in specs:
        compiler.matcher(spec)
    compiler.matcher(specs[-1])  # a hit
    assert compiler.num_compiled == before + 6
    assert len(compiler._cache) == 4
    compiler.matcher(specs[0])  # evicted: compiled again
    assert compiler.num_compiled == before + 7


@pytest.mark.parametrize(
    "spec",
    [{"regex": "("}, {"json_schema": '{"type": 3}'}, {"grammar": "start: nope"}, {"choice": []}],
)
def test_bad_specs_raise_validation_error(compiler: GrammarCompiler, spec) -> None:
    with pytest.raises(ValidationError, match="params.structured_output"):
        compiler.validate(spec)


def test_constraint_excludes_ignore_eos() -> None:
    params = SamplingParams(ignore_eos=True, structured_output={"regex": "a"})
    with pytest.raises(ValidationError, match="ignore_eos"):
        params.validate(max_logprobs=5)
    assert SamplingParams.from_dict(params.to_dict()).structured_output == {"regex": "a"}


def _step(seq) -> SchedulerOutput:
    out = SchedulerOutput(0)
    out.scheduled.append((seq, 1))
    seq.num_computed_tokens = len(seq.token_ids) - 1  # its last token is computed this step
    return out


def _walk(compiler: GrammarCompiler, spec: dict, rng: random.Random) -> tuple[list, list]:
    """Sample a valid output token by token from the masks; return (tokens, masks)."""
    matchers = SeqMatchers(compiler)
    req = Request("r", [1, 2, 3], SamplingParams(structured_output=spec))
    seq = req.seqs[0]
    masks = []
    for _ in range(200):
        step = matchers.step_masks(_step(seq), lambda _id: spec)
        row = decode_rows(step.rows, VOCAB)[step.row_index[0]]
        masks.append(row.tolist())
        ids = allowed_ids(row, VOCAB)
        token = rng.choice(ids)
        seq.token_ids.append(token)
        if token in compiler.eos_token_ids:
            break
    return seq.output_token_ids, masks


@pytest.mark.parametrize(
    "spec",
    [{"json_schema": json.dumps(SCHEMA)}, {"regex": "[a-c]{2,5}(x|yz)"}, {"choice": ["ab", "abc"]}],
)
def test_replayed_matcher_gives_the_same_masks(compiler: GrammarCompiler, spec) -> None:
    tokens, masks = _walk(compiler, spec, random.Random(0))
    assert tokens[-1] in compiler.eos_token_ids  # the walk completed the grammar
    text = compiler._hf.decode(tokens[:-1])
    if "json_schema" in spec:
        obj = json.loads(text)
        assert set(obj) == {"a", "b"}
    # A recovered request: a new Sequence holding k stored outputs, a fresh set of matchers.
    for k in range(len(tokens)):
        req = Request(
            "r", [1, 2, 3], SamplingParams(structured_output=spec), output_token_ids=[tokens[:k]]
        )
        fresh = SeqMatchers(compiler)
        step = fresh.step_masks(_step(req.seqs[0]), lambda _id: spec)
        assert decode_rows(step.rows, VOCAB)[0].tolist() == masks[k], k


def test_only_sampling_constrained_sequences_get_masks(compiler: GrammarCompiler) -> None:
    matchers = SeqMatchers(compiler)
    a = Request("a", [1, 2, 3, 4], SamplingParams(structured_output={"regex": "b+"})).seqs[0]
    b = Request("b", [1, 2, 3, 4], SamplingParams()).seqs[0]
    out = SchedulerOutput(0)
    out.scheduled += [(a, 2), (b, 4)]  # a: a prefill chunk that samples nothing
    specs = {"a": {"regex": "b+"}, "b": None}
    assert matchers.step_masks(out, specs.get) is None
    out.scheduled = [(a, 4), (b, 4)]
    assert matchers.step_masks(out, specs.get).seq_ids == ["a/0"]


def test_structural_tag_constrains_only_the_tagged_segment(compiler: GrammarCompiler) -> None:
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "end": "</f>"}],
        "triggers": ["<f>"],
    }  # fmt: skip
    spec = {"structural_tag": json.dumps(tag)}
    encode = compiler._hf.encode
    ok = compiler.matcher(spec)
    assert ok.consume_tokens(encode('free text <f>{"a":1}</f> more', add_special_tokens=False))
    bad = compiler.matcher(spec)
    assert not bad.consume_tokens(encode('free text <f>{"b":1}', add_special_tokens=False))


@pytest.mark.parametrize("vocab", [509, 512, 4096])
def test_executor_applies_rows_like_the_reference(vocab: int) -> None:
    import torch

    from executor_svc.features.structured.token_mask import apply_token_masks

    rng = np.random.default_rng(vocab)
    allowed = [sorted(rng.choice(vocab, size=k, replace=False).tolist()) for k in (1, 7, 300)]
    logits = torch.randn(5, vocab)
    want = logits.clone()
    rows = [0, 2, 4]
    apply_token_masks(logits, rows, [pack_ids(ids, vocab) for ids in allowed])
    for r, ids in zip(rows, allowed, strict=True):
        keep = torch.full((vocab,), float("-inf"))
        keep[ids] = want[r, ids]
        want[r] = keep
    assert torch.equal(logits, want)  # rows 1 and 3 untouched, the others masked exactly
