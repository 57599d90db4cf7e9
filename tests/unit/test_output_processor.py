"""Stop conditions in vLLM's order, streamed deltas, logprobs and resume.

Outputs are spelled one token per UTF-8 byte (every byte is a token of a byte-level BPE), so
each test controls exactly where tokens split characters and stop strings.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.output.processor import (
    OutputDelta,
    SequenceOutputState,
    TokenAlternative,
)
from tests.unit.test_detokenizer import byte_level_tokenizer

TOK = byte_level_tokenizer()
EOS = TOK.convert_tokens_to_ids("<|eos|>")
BOS = TOK.convert_tokens_to_ids("<|bos|>")
PROMPT = TOK.encode("the cat", add_special_tokens=False)
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def _byte_token_ids() -> list[int]:
    # GPT-2's byte -> printable character table, which ByteLevel's alphabet uses.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return [TOK.convert_tokens_to_ids(c) for c in chars]


BYTE_IDS = _byte_token_ids()


def ids(text: str) -> list[int]:
    """One token per UTF-8 byte of `text`."""
    return [BYTE_IDS[b] for b in text.encode()]


def make_state(max_model_len: int = 1000, **params) -> SequenceOutputState:
    params.setdefault("max_tokens", 100)
    return SequenceOutputState(
        TOK, SamplingParams(**params), PROMPT, eos_token_ids=[EOS], max_model_len=max_model_len
    )


def feed(state: SequenceOutputState, token_ids: list[int]) -> list[OutputDelta]:
    """Append one token per call until the sequence finishes."""
    deltas = []
    for t in token_ids:
        deltas.append(state.append([t]))
        if state.finished:
            break
    return deltas


def texts(deltas: list[OutputDelta]) -> list[str]:
    return [d.text for d in deltas]


def test_byte_tokens_are_single_bytes():
    assert TOK.decode(ids("héllo 😀")) == "héllo 😀"
    assert len(ids("😀")) == 4


def test_deltas_carry_complete_characters_tokens_and_offsets():
    state = make_state()
    deltas = feed(state, ids("hé😀!"))
    assert texts(deltas) == ["h", "", "é", "", "", "", "😀", "!"]
    assert [d.token_offset for d in deltas] == list(range(8))
    assert [d.token_ids for d in deltas] == [[t] for t in ids("hé😀!")]
    assert not any(d.finished for d in deltas)
    assert state.text == "hé😀!" and state.output_token_ids == ids("hé😀!")


def test_eos_stops_without_its_text():
    state = make_state(skip_special_tokens=False)
    deltas = feed(state, [*ids("hi"), EOS, *ids("never")])
    last = deltas[-1]
    assert (last.finish_status, last.stop_reason) == (STOPPED, None)
    assert last.token_ids == [EOS] and last.token_offset == 2 and last.text == ""
    assert state.text == "hi" and state.output_token_ids == [*ids("hi"), EOS]


def test_eos_before_min_tokens_is_ignored():
    state = make_state(min_tokens=3)
    deltas = feed(state, [EOS, *ids("a"), EOS, *ids("b")])
    assert len(deltas) == 3  # the second EOS is token 3: min_tokens reached, it stops
    assert [d.finish_status for d in deltas] == [None, None, STOPPED]
    assert state.text == "a" and state.output_token_ids == [EOS, *ids("a"), EOS]


def test_eos_text_kept_when_ignored_and_not_skipped():
    state = make_state(min_tokens=2, skip_special_tokens=False)
    feed(state, [EOS, *ids("a"), EOS])
    assert state.text == "<|eos|>a"


def test_ignore_eos_runs_to_max_tokens():
    state = make_state(ignore_eos=True, max_tokens=4)
    deltas = feed(state, [EOS, EOS, *ids("ab"), EOS])
    assert len(deltas) == 4 and deltas[-1].finish_status is LENGTH
    assert state.text == "ab" and state.stop_reason is None


def test_stop_token_id_sets_stop_reason():
    stop_id = ids("x")[0]
    state = make_state(stop_token_ids=[stop_id])
    deltas = feed(state, ids("abxcd"))
    assert texts(deltas) == ["a", "b", ""]
    assert (deltas[-1].finish_status, deltas[-1].stop_reason) == (STOPPED, stop_id)
    assert state.text == "ab" and state.output_token_ids == ids("abx")


def test_stop_token_text_with_include_stop_str_in_output():
    state = make_state(stop_token_ids=ids("x"), include_stop_str_in_output=True)
    assert texts(feed(state, ids("abxcd"))) == ["a", "b", "x"]


def test_stop_token_before_min_tokens_is_ordinary_output():
    state = make_state(stop_token_ids=ids("x"), min_tokens=3)
    feed(state, ids("xaxbx"))
    assert state.text == "xa" and len(state.output_token_ids) == 3


def test_eos_checked_before_stop_token_ids():
    state = make_state(stop_token_ids=[EOS])
    assert feed(state, [EOS])[-1].stop_reason is None


def test_stop_string_spanning_two_tokens():
    state = make_state(stop=["ab"])
    deltas = feed(state, ids("xabc"))
    # "a" is held back while it may start "ab"; the match then cuts the text before it.
    assert texts(deltas) == ["x", "", ""]
    assert (deltas[-1].finish_status, deltas[-1].stop_reason) == (STOPPED, "ab")
    assert deltas[-1].token_ids == ids("b")
    assert state.text == "x" and state.output_token_ids == ids("xab")


def test_stop_string_included_in_output():
    state = make_state(stop=["ab"], include_stop_str_in_output=True)
    deltas = feed(state, ids("xabc"))
    assert texts(deltas) == ["x", "a", "b"]  # nothing needs holding back
    assert state.text == "xab" and deltas[-1].stop_reason == "ab"


def test_held_back_text_released_when_prefix_breaks():
    state = make_state(stop=["abc"])
    assert texts(feed(state, ids("xabd"))) == ["x", "", "", "abd"]


def test_held_back_text_released_on_length_finish():
    state = make_state(stop=["abc"], max_tokens=3)
    deltas = feed(state, ids("xab"))
    assert texts(deltas) == ["x", "", "ab"] and deltas[-1].finish_status is LENGTH


def test_held_back_text_released_on_abort():
    state = make_state(stop=["abc"])
    assert texts(feed(state, ids("xa"))) == ["x", ""]
    delta = state.finish(RequestStatus.FINISHED_ABORTED)
    assert (delta.text, delta.token_ids, delta.token_offset) == ("a", [], 2)
    assert state.finish_status is RequestStatus.FINISHED_ABORTED


def test_hold_back_only_what_could_start_a_stop_string():
    state = make_state(stop=["hello", "yes"])
    # "he" could start "hello", "y" could start "yes"; "x" and "hex" cannot start either.
    assert texts(feed(state, ids("hexhey"))) == ["", "", "hex", "", "", "he"]


def test_stop_string_inside_one_multi_token_call():
    state = make_state(stop=["lo w"])
    delta = state.append(ids("hello world"))
    assert (delta.text, delta.stop_reason, delta.finish_status) == ("hel", "lo w", STOPPED)
    assert delta.token_ids == ids("hello w")  # tokens after the stopping one are dropped


def test_earliest_stop_string_wins():
    state = make_state(stop=["world", "lo"])
    delta = state.append(ids("hello world"))
    assert (state.text, delta.stop_reason) == ("hel", "lo")


def test_stop_string_with_multi_byte_characters():
    state = make_state(stop=["日本"])
    deltas = feed(state, ids("a日本b"))
    assert "".join(texts(deltas)) == "a" == state.text and deltas[-1].stop_reason == "日本"


def test_stop_string_within_min_tokens_never_fires_later():
    state = make_state(stop=["ab"], min_tokens=3, max_tokens=4)
    deltas = feed(state, ids("abcd"))
    assert deltas[-1].finish_status is LENGTH and state.text == "abcd"


def test_stop_string_ending_at_min_tokens_fires():
    state = make_state(stop=["ab"], min_tokens=2)
    assert feed(state, ids("abcd"))[-1].stop_reason == "ab" and state.text == ""


def test_stop_string_beats_max_tokens_on_the_same_token():
    state = make_state(stop=["ab"], max_tokens=3)
    deltas = feed(state, ids("xab"))
    assert (deltas[-1].finish_status, deltas[-1].stop_reason) == (STOPPED, "ab")


def test_eos_beats_max_tokens_on_the_same_token():
    state = make_state(max_tokens=2)
    assert feed(state, [*ids("a"), EOS])[-1].finish_status is STOPPED


def test_max_tokens_exact_count():
    state = make_state(max_tokens=5)
    deltas = feed(state, ids("abcdefgh"))
    assert [d.finish_status for d in deltas] == [None] * 4 + [LENGTH]
    assert state.output_token_ids == ids("abcde") and state.text == "abcde"


def test_max_tokens_in_one_multi_token_call():
    state = make_state(max_tokens=5)
    delta = state.append(ids("abcdefgh"))
    assert delta.token_ids == ids("abcde") and delta.text == "abcde"
    assert delta.finish_status is LENGTH


def test_max_model_len():
    state = make_state(max_model_len=len(PROMPT) + 3)
    deltas = feed(state, ids("abcdef"))
    assert len(deltas) == 3 and deltas[-1].finish_status is LENGTH and state.text == "abc"


def test_length_finish_flushes_an_incomplete_character():
    state = make_state(max_tokens=3)
    deltas = feed(state, ids("a😀"))
    # The sequence ends inside the emoji: nothing can complete it, so it is released as U+FFFD.
    assert texts(deltas) == ["a", "", "\ufffd"]
    assert state.text == TOK.decode(ids("a😀")[:3])


def test_append_after_finish_is_an_error():
    state = make_state(max_tokens=1)
    state.append(ids("a"))
    with pytest.raises(RuntimeError, match="already finished"):
        state.append(ids("b"))


def test_logprob_entries():
    state = make_state(logprobs=2)
    a, b, c = ids("abc")
    delta = state.append([a, b], [-0.1, -0.7], [[(a, -0.1), (c, -2.5), (b, -3.0)], []])
    assert [e.token_id for e in delta.logprobs] == [a, b]
    assert math.isclose(delta.logprobs[0].logprob, -0.1)
    assert delta.logprobs[0].top == [TokenAlternative(a, -0.1, "a"), TokenAlternative(c, -2.5, "c")]
    assert delta.logprobs[1].top == []


def test_logprob_alternative_text_of_special_and_partial_tokens():
    state = make_state(logprobs=2)
    delta = state.append(ids("a"), [-0.2], [[(EOS, -0.5), (ids("😀")[0], -1.0)]])
    assert [alt.text for alt in delta.logprobs[0].top] == ["<|eos|>", "\ufffd"]


def test_logprobs_only_when_requested():
    assert make_state().append(ids("a"), [-0.1], [[]]).logprobs == []
    with pytest.raises(ValueError, match="logprobs"):
        make_state(logprobs=1).append(ids("a"))


def test_logprob_entries_stop_with_the_tokens():
    state = make_state(logprobs=0, max_tokens=2)
    delta = state.append(ids("abc"), [-1.0, -2.0, -3.0], [[], [], []])
    assert [e.logprob for e in delta.logprobs] == [-1.0, -2.0]


def test_grouping_of_tokens_does_not_change_the_result():
    tokens = ids("xy日本 ab abc zz")
    one = make_state(stop=["abc"], max_tokens=50)
    whole = make_state(stop=["abc"], max_tokens=50)
    one_text = "".join(texts(feed(one, tokens)))
    delta = whole.append(tokens)
    assert delta.text == one_text == one.text == whole.text == "xy日本 ab "
    assert delta.stop_reason == one.stop_reason == "abc"


RESUME_ALPHABET = ["a", "b", "c", " ", "é", "日", "😀", "<eos>"]


@settings(max_examples=80, deadline=None)
@given(
    words=st.lists(st.sampled_from(RESUME_ALPHABET), min_size=1, max_size=12),
    split=st.integers(0, 60),
    stop=st.sampled_from([[], ["bc"], ["c 日", "ab"], ["😀a"]]),
    min_tokens=st.integers(0, 4),
    include=st.booleans(),
)
def test_resume_from_any_offset_matches_uninterrupted_run(words, split, stop, min_tokens, include):
    tokens = [t for w in words for t in ([EOS] if w == "<eos>" else ids(w))]
    params = dict(stop=stop, min_tokens=min_tokens, include_stop_str_in_output=include)
    params["max_tokens"] = 40
    full = feed(make_state(**params), tokens)
    split = min(split, len(full))
    resumed = SequenceOutputState(
        TOK,
        SamplingParams(**params),
        PROMPT,
        eos_token_ids=[EOS],
        max_model_len=1000,
        output_token_ids=tokens[:split],
    )
    assert resumed.num_output_tokens == split
    assert feed(resumed, tokens[split : len(full)]) == full[split:]
    streamed = "".join(texts(full))
    assert streamed == resumed.text[: resumed.num_streamed_chars]
    assert streamed == resumed.text or not resumed.finished  # held text released at the end


def test_resume_with_explicit_stream_position_resends_text():
    state = SequenceOutputState(
        TOK,
        SamplingParams(max_tokens=10),
        PROMPT,
        eos_token_ids=[EOS],
        max_model_len=1000,
        output_token_ids=ids("abc"),
        num_streamed_chars=1,
    )
    delta = state.append(ids("d"))
    assert (delta.text, delta.token_offset, delta.token_ids) == ("bcd", 3, ids("d"))


def test_resume_of_a_finished_sequence_is_finished():
    state = SequenceOutputState(
        TOK,
        SamplingParams(max_tokens=10, stop=["b"]),
        PROMPT,
        eos_token_ids=[EOS],
        max_model_len=1000,
        output_token_ids=ids("abc"),
    )
    assert state.finished and state.stop_reason == "b" and state.text == "a"
    assert state.output_token_ids == ids("ab")


@settings(max_examples=120, deadline=None)
@given(
    words=st.lists(st.sampled_from([*RESUME_ALPHABET, "<stop-id>", "<bos>"]), max_size=14),
    stop=st.sampled_from([[], ["bc"], ["c 日", "ab"]]),
    min_tokens=st.integers(0, 4),
    max_tokens=st.integers(1, 30),
    ignore_eos=st.booleans(),
    include=st.booleans(),
    streamed=st.one_of(st.none(), st.integers(0, 3)),
)
def test_append_token_equals_append(
    words, stop, min_tokens, max_tokens, ignore_eos, include, streamed
):
    """The engine's per-token call (with its short path) gives append()'s text and finish."""
    special = {"<eos>": [EOS], "<stop-id>": ids("z"), "<bos>": [BOS]}
    tokens = [t for w in words for t in special.get(w, ids(w))] + ids("abc 日本😀") * 3
    params = SamplingParams(
        stop=stop,
        stop_token_ids=ids("z"),
        min_tokens=min(min_tokens, max_tokens),
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        include_stop_str_in_output=include,
    )

    def state() -> SequenceOutputState:
        # Resumed from two tokens with a stream position, to cover text owed from a resume.
        return SequenceOutputState(
            TOK,
            params,
            PROMPT,
            eos_token_ids=[EOS],
            max_model_len=len(PROMPT) + 25,
            output_token_ids=ids("é"),
            num_streamed_chars=streamed,
        )

    a, b = state(), state()
    for t in tokens:
        if a.finished:
            break
        assert b.append_token(t) == a.append([t]).text
        assert (b.finish_status, b.stop_reason) == (a.finish_status, a.stop_reason)
    assert a.finished and b.finished
    assert (a.text, a.output_token_ids) == (b.text, b.output_token_ids)
    with pytest.raises(RuntimeError, match="finished"):
        b.append_token(tokens[0])
