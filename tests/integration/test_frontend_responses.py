"""The Responses API (`/v1/responses`) and `best_of` on `/v1/completions`, driven by the
official `openai` package and plain HTTP, in front of a real stack on the tiny demo model."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.support.stack import llmserve_stack  # noqa: F401 - the fixture

PROMPT = "The quick brown fox"
OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _chat(oai, model, messages, max_tokens):
    return oai.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0
    ).choices[0]


def _events(oai, **args) -> list:
    return list(oai.responses.create(**args, stream=True))


# --- /v1/responses ---------------------------------------------------------------------------


def test_response_is_the_chat_answer_in_the_responses_shape(oai, model):
    want = _chat(oai, model, [{"role": "user", "content": "Hi"}], 8)
    got = oai.responses.create(model=model, input="Hi", max_output_tokens=8, temperature=0)
    assert got.object == "response" and got.id.startswith("resp_")
    assert got.model == model and got.created_at > 0
    if got.status == "completed":
        assert got.completed_at >= got.created_at
    assert got.status == ("incomplete" if want.finish_reason == "length" else "completed")
    (item,) = got.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    assert part.text == got.output_text == want.message.content
    u = got.usage
    assert u.output_tokens == 8 if want.finish_reason == "length" else u.output_tokens <= 8
    assert u.input_tokens > 0 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens == 0
    assert u.output_tokens_details.reasoning_tokens == 0


def test_streamed_response_events_in_order_and_equal_to_the_whole(oai, model):
    args = dict(model=model, input="Tell me", max_output_tokens=12, temperature=0)
    whole = oai.responses.create(**args)
    events = _events(oai, **args)
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    last = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert types == OPENING + ["response.output_text.delta"] * len(deltas) + CLOSING + [last]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert deltas and all(e.delta for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == whole.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[2].item.status == "in_progress" and events[3].part.text == ""
    assert events[-4].text == events[-3].part.text == events[-2].item.content[0].text == text
    final = events[-1].response
    assert final.output_text == text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id and final.id.startswith("resp_")
    assert {e.item_id for e in deltas} == {events[2].item.id}


def test_instructions_are_a_system_message_before_the_input(oai, model):
    want = _chat(
        oai,
        model,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        8,
    )
    got = oai.responses.create(
        model=model, instructions="Be brief.", input="Hi", max_output_tokens=8, temperature=0
    )
    assert got.output_text == want.message.content
    assert got.instructions == "Be brief."


def test_message_list_input_with_text_parts(oai, model):
    want = _chat(
        oai,
        model,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "More\nplease"},
        ],
        8,
    )
    got = oai.responses.create(
        model=model,
        input=[
            {"role": "developer", "content": "Be brief."},  # ranked as a system message
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello"},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "More"},
                    {"type": "input_text", "text": "please"},
                ],
            },
        ],
        max_output_tokens=8,
        temperature=0,
    )
    assert got.output_text == want.message.content


def test_max_output_tokens_makes_it_incomplete(oai, model):
    want = _chat(oai, model, [{"role": "user", "content": PROMPT}], 2)
    assert want.finish_reason == "length", "the greedy answer should run past two tokens"
    args = dict(model=model, input=PROMPT, max_output_tokens=2, temperature=0)
    got = oai.responses.create(**args)
    assert got.status == "incomplete"
    assert got.incomplete_details.reason == "max_output_tokens"
    assert got.output[0].status == "incomplete" and got.usage.output_tokens == 2
    assert got.output_text == want.message.content
    events = _events(oai, **args)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_accepted_fields_are_echoed(oai, model):
    got = oai.responses.create(
        model=model, input="Hi", max_output_tokens=2, temperature=0, top_p=0.5,
        store=False, metadata={"k": "v"}, user="u-1", tools=[], truncation="disabled",
        text={"format": {"type": "text"}},
    )  # fmt: skip
    assert got.metadata == {"k": "v"} and got.user == "u-1"
    assert got.store is False and got.temperature == 0 and got.top_p == 0.5
    assert got.max_output_tokens == 2 and got.tools == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),  # without tools, as on chat
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
    ],
)
def test_unsupported_fields_are_400_naming_them(frontend, extra, param):
    status, err = frontend.request("POST", "/v1/responses", {"input": "Hi", **extra})
    assert status == 400, err
    assert err["error"]["param"] == param
    assert param.split("[")[0].split(".")[0] in err["error"]["message"]


def test_unsupported_field_through_the_official_client(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input="Hi", previous_response_id="resp_x")
    assert "previous_response_id" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input="Hi")


# --- best_of on /v1/completions --------------------------------------------------------------


def _completion(oai, model, **args):
    return oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, **args)


def test_best_of_greedy_returns_n_copies_of_the_greedy_answer(oai, model):
    greedy = _completion(oai, model, temperature=0).choices[0].text
    got = _completion(oai, model, temperature=0, n=2, best_of=3, extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [greedy, greedy]
    assert all(c.logprobs is None for c in got.choices)  # asked for internally only
    assert got.usage.completion_tokens == 3 * 6  # every candidate was generated


def test_best_of_returns_the_n_candidates_of_highest_cumulative_logprob(oai, model):
    seeded = dict(temperature=1.0, seed=4321, extra_body={"ignore_eos": True})
    # The same seeded candidates, all of them, with their sampled tokens' logprobs.
    all4 = _completion(oai, model, n=4, logprobs=0, **seeded).choices
    assert len({c.text for c in all4}) > 1, "sampling should give different candidates"
    ranked = sorted(all4, key=lambda c: -sum(c.logprobs.token_logprobs))
    got = _completion(oai, model, n=2, best_of=4, **seeded)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in got.choices)
    # With logprobs asked for, they come back, those of the chosen candidates, best first.
    with_lp = _completion(oai, model, n=2, best_of=4, logprobs=1, **seeded).choices
    scores = [sum(c.logprobs.token_logprobs) for c in with_lp]
    assert scores == pytest.approx([sum(c.logprobs.token_logprobs) for c in ranked[:2]])
    assert scores[0] >= scores[1]


def test_best_of_with_several_prompts_ranks_each_prompt_alone(oai, model):
    seeded = dict(temperature=1.0, seed=99, max_tokens=5, extra_body={"ignore_eos": True})
    prompts = [PROMPT, "Hello"]
    got = oai.completions.create(model=model, prompt=prompts, n=1, best_of=3, **seeded)
    assert [c.index for c in got.choices] == [0, 1]
    for i, prompt in enumerate(prompts):
        cands = oai.completions.create(model=model, prompt=prompt, n=3, logprobs=0, **seeded)
        best = max(cands.choices, key=lambda c: sum(c.logprobs.token_logprobs))
        assert got.choices[i].text == best.text


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"n": 3, "best_of": 2}, "best_of must be >= n"),
        ({"best_of": 2, "stream": True}, "stream"),
        ({"best_of": 100}, "best_of must be in"),
        ({"best_of": 0}, "best_of must be >= n"),
    ],
)
def test_bad_best_of_is_400(frontend, extra, needle):
    status, err = frontend.request("POST", "/v1/completions", {"prompt": "x", **extra})
    assert status == 400, err
    assert err["error"]["param"] == "best_of" and needle in err["error"]["message"]


# --- last: it restarts the module's scheduler -------------------------------------------------


def test_streamed_responses_survive_a_scheduler_restart(llmserve_stack, frontend, oai, model):  # noqa: F811
    inputs = [f"Story number {i}:" for i in range(8)]
    args = dict(model=model, max_output_tokens=200, temperature=0)
    want = [oai.responses.create(input=x, **args).output_text for x in inputs]
    got: list[list[str] | None] = [None] * len(inputs)
    progress = [0] * len(inputs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            types = []
            for e in oai.responses.create(input=inputs[i], stream=True, **args):
                types.append(e.type)
                if e.type == "response.output_text.delta":
                    progress[i] += 1
                    got[i] = [*(got[i] or []), e.delta]
            assert types[-1] in ("response.completed", "response.incomplete"), types
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(progress) < 3:  # every stream is under way
        assert time.monotonic() < deadline, progress
        time.sleep(0.01)
    llmserve_stack.kill_scheduler()
    killed_at = list(progress)
    time.sleep(0.5)
    llmserve_stack.start_scheduler()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert ["".join(g or []) for g in got] == want
    cut = [p < len(g or []) for p, g in zip(killed_at, got, strict=True)]
    assert any(cut), "every stream had finished before the kill"
    assert "frontend.stream_interrupted" in frontend.log()
