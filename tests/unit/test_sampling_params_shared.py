"""One SamplingParams model (protos/sampling.py) for the client and the scheduler: the same
fields and defaults on both sides, and a proto round trip through both is the identity."""

from __future__ import annotations

import dataclasses
import json

import pytest

from client import SamplingParams as ClientParams
from client import structured
from protos import sampling
from protos import scheduler_pb2 as pb
from scheduler_svc.api.convert import params_from_proto
from scheduler_svc.core.sampling_params import SamplingParams as SchedulerParams
from scheduler_svc.core.sampling_params import ValidationError
from scheduler_svc.features.pooling.params import EmbedSamplingParams


def _defaults(cls: type) -> list[tuple[str, object]]:
    return [
        (f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        for f in dataclasses.fields(cls)
    ]


def test_both_sides_are_the_one_model() -> None:
    assert SchedulerParams is sampling.SamplingParams
    assert ValidationError is sampling.ValidationError
    assert issubclass(ClientParams, sampling.SamplingParams)
    assert _defaults(ClientParams) == _defaults(SchedulerParams)
    assert SchedulerParams().to_proto() == ClientParams().to_proto()
    # vLLM's defaults, as both sides had them before they were one model.
    assert _defaults(SchedulerParams)[:11] == [
        ("n", 1), ("max_tokens", 16), ("min_tokens", 0), ("temperature", 1.0), ("top_p", 1.0),
        ("top_k", -1), ("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0), ("seed", None),
    ]  # fmt: skip


EVERY_FIELD = {
    "n": 2,
    "max_tokens": 9,
    "min_tokens": 1,
    "temperature": 0.5,
    "top_p": 0.75,
    "top_k": 7,
    "min_p": 0.125,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.25,
    "seed": 2**62,
    "stop": ["END", "\n\n"],
    "stop_token_ids": [3, 4],
    "include_stop_str_in_output": True,
    "ignore_eos": False,
    "logprobs": 3,
    "skip_special_tokens": False,
    "logit_bias": {5: -100.0, 17: 2.5},
    "prompt_logprobs": 0,
    "disable_speculation": True,
}  # floats exact in float32, so the wire keeps them


@pytest.mark.parametrize(
    "so",
    [
        None,
        structured.regex("[0-9]+"),
        structured.choice(["yes", "no"]),
        structured.json_object(),
        structured.json_schema({"type": "integer"}),
    ],
)
def test_a_round_trip_through_both_sides_is_the_identity(so) -> None:
    fields = {**EVERY_FIELD, "min_tokens": 0 if so else 1}
    client = ClientParams(**fields, structured_output=so)
    wire = client.to_proto()
    sched = params_from_proto(wire)
    sched.validate(max_logprobs=20, vocab_size=512)
    assert sched == SchedulerParams(
        **fields, structured_output=None if so is None else {so.kind: so.value}
    )
    assert sched.to_proto() == wire
    assert ClientParams.from_proto(sched.to_proto()) == client
    # The stored form is one: a client's dict loads on the scheduler's side and back.
    stored = json.loads(json.dumps(client.to_dict()))
    assert stored == json.loads(json.dumps(sched.to_dict()))
    assert SchedulerParams.from_dict(stored) == sched
    assert ClientParams.from_dict(stored) == client


def test_a_record_written_before_the_shared_model_loads() -> None:
    """A dict as scheduler_svc/core/sampling_params.py's to_dict wrote it (dataclasses.asdict,
    then JSON) before issue 43, plus a field from a later version, which is ignored."""
    record = {
        "n": 1, "max_tokens": 32, "min_tokens": 0, "temperature": 0.0, "top_p": 1.0,
        "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "repetition_penalty": 1.0, "seed": 7, "stop": ["."], "stop_token_ids": [2],
        "include_stop_str_in_output": False, "ignore_eos": False, "logprobs": 1,
        "skip_special_tokens": True, "logit_bias": {"12": -100.0}, "prompt_logprobs": None,
        "structured_output": {"choice": ["a", "b"]}, "disable_speculation": False,
        "from_a_later_version": 1,
    }  # fmt: skip
    params = SchedulerParams.from_dict(record)
    assert params == SchedulerParams(
        max_tokens=32, temperature=0.0, seed=7, stop=["."], stop_token_ids=[2], logprobs=1,
        logit_bias={12: -100.0}, structured_output={"choice": ["a", "b"]},
    )  # fmt: skip
    del record["from_a_later_version"]
    record["logit_bias"] = {12: -100.0}
    assert params.to_dict() == record


def test_each_side_keeps_its_own_answers() -> None:
    # The scheduler refuses a constraint with no kind; the client reads it as none.
    msg = pb.SamplingParams(structured_output=pb.StructuredOutput())
    with pytest.raises(ValidationError, match="params.structured_output must set one of its"):
        params_from_proto(msg)
    assert ClientParams.from_proto(msg).structured_output is None
    # The client's conveniences: one stop string, and the length left to the server.
    client = ClientParams(stop="END", max_tokens=None)
    assert client.stop == ["END"] and not client.to_proto().HasField("max_tokens")
    assert params_from_proto(client.to_proto()).max_tokens == 16


def test_the_embedding_subclass_keeps_its_pooling() -> None:
    params = EmbedSamplingParams(max_tokens=0, temperature=0.0)
    assert params.pooling is None and params.to_dict()["pooling"] is None
    assert params.to_proto() == SchedulerParams(max_tokens=0, temperature=0.0).to_proto()
