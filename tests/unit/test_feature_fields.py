"""The generic points the scheduler's features fill (features/base.py): a request's feature
entries (from the Generate call, on the handle, stored with it and restored by recovery),
GetServerInfo's feature fields, and the public RPCs features serve. LoRA is the feature that
uses them all; its stored field keeps the format of the build before them (hash field "lora",
[name, path] as JSON), so records that build wrote recover."""

from __future__ import annotations

import asyncio
import json

import redis

from protos import scheduler_pb2 as pb
from scheduler_svc.api import convert
from scheduler_svc.api.servicer import SchedulerServicer
from scheduler_svc.core.request import Request
from scheduler_svc.core.sampling_params import SamplingParams
from scheduler_svc.engine.config import EngineConfig, GenerateInput, ServerInfo
from scheduler_svc.engine.streams import RequestHandle
from scheduler_svc.features.base import Features
from scheduler_svc.features.lora.feature import Lora
from scheduler_svc.features.lora.ref import LoraRef, lora_root_hash
from scheduler_svc.features.registry import feature_rpcs
from scheduler_svc.state.records import decode_record
from scheduler_svc.state.store import RequestStore

PARAMS = SamplingParams(max_tokens=8, seed=7).to_dict()


def _previous_build_hash(lora: list[str] | None) -> dict[str, str]:
    """A request's hash exactly as the build before issue 43's scheduler pass wrote it
    (RequestStore.create: the base fields, then "lora" as JSON when the request had one)."""
    fields = {
        "v": "1",
        "prompt": json.dumps([1, 2, 3]),
        "params": json.dumps(PARAMS),
        "priority": "0",
        "arrival_time": repr(1.5),
        "n": "1",
        "status": "active",
        "finish_reasons": json.dumps([None]),
        "stop_reasons": json.dumps([None]),
        "error": "",
    }
    if lora is not None:
        fields["lora"] = json.dumps(lora)
    return fields


def _lora_features(store: RequestStore) -> Features:
    return Features([Lora.build(EngineConfig([], ""), None, store, lambda: None)])


def test_a_lora_record_of_the_previous_build_recovers_and_is_rewritten_the_same(redis_url):
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    old = _previous_build_hash(["ad", "/adapters/ad"])
    raw.hset("llmserve:request:old", mapping=old)
    raw.sadd("llmserve:index:unfinished", "old")

    async def recover_and_rewrite() -> RequestHandle:
        store = RequestStore(redis_url)
        features = _lora_features(store)
        [rec] = await store.list_unfinished()
        assert rec.features == {"lora": ["ad", "/adapters/ad"]}
        # What Recovery.recover does: the entries restored, then admitted (RequestTable.add).
        handle = RequestHandle.from_stored(rec, SamplingParams.from_dict(rec.params))
        features.restore(handle, rec.features)
        for admit in features.admit:
            admit(handle)
        # What Recovery.resync_store does: the handle written again from memory.
        raw.delete("llmserve:request:old")
        await store.create(handle.to_stored(features.stored_fields(handle)), honour_abort=False)
        await store.close()
        return handle

    handle = asyncio.run(recover_and_rewrite())
    ref = LoraRef("ad", "/adapters/ad")
    assert handle.features == {"lora": ref}
    req = Request.of(handle)
    assert req.tag == ref and req.cache_root == lora_root_hash(ref)
    assert raw.hgetall("llmserve:request:old") == old  # the same fields, the same bytes


def test_a_base_model_record_has_no_feature_entries_and_stores_none(redis_url):
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    old = _previous_build_hash(None)
    raw.hset("llmserve:request:base", mapping=old)

    async def rewrite() -> RequestHandle:
        store = RequestStore(redis_url)
        features = _lora_features(store)
        rec = await store.get("base")
        assert rec is not None and rec.features == {}
        handle = RequestHandle.from_stored(rec, SamplingParams.from_dict(rec.params))
        features.restore(handle, rec.features)
        raw.delete("llmserve:request:base")
        await store.create(handle.to_stored(features.stored_fields(handle)), honour_abort=False)
        await store.close()
        return handle

    handle = asyncio.run(rewrite())
    assert handle.features == {} and handle.core_fields == {}
    assert raw.hgetall("llmserve:request:base") == old


def test_a_stored_field_that_is_not_json_is_ignored():
    fields = {k.encode(): v.encode() for k, v in _previous_build_hash(["a", "/p"]).items()}
    fields[b"later_field"] = b"not json"
    assert decode_record("r", fields).features == {"lora": ["a", "/p"]}


def test_the_generate_calls_lora_adapter_is_the_features_field_of_its_input(redis_url):
    """Resolving it to the handle's entry needs executors (test_lora_serving covers it)."""
    features = _lora_features(RequestStore(redis_url))
    assert features.from_request(pb.GenerateRequest(text="x", lora_adapter="ad")) == {"lora": "ad"}
    assert features.from_request(pb.GenerateRequest(text="x")) == {}  # the base model
    assert features.handle_fields(GenerateInput(req_id="r", params=SamplingParams())) == {}


def test_server_info_feature_fields_reach_the_proto_under_their_names():
    info = ServerInfo("m", 64, 16, 0, 0, 0, 0.0, [], 20, 100, "fcfs", "recompute", 0, 0.0)
    info.features.update(
        lora_adapters=[{"name": "ad", "path": "/p", "rank": 8}],
        max_loras=3,
        num_speculative_tokens=4,
        spec_decode_acceptance_rate=0.5,
    )
    msg = convert.server_info_to_proto(info)
    assert list(msg.lora_adapters) == [pb.LoraAdapter(name="ad", path="/p", rank=8)]
    assert msg.max_loras == 3 and msg.num_speculative_tokens == 4
    assert msg.spec_decode_acceptance_rate == 0.5 and msg.model == "m"
    # Without the features' fields: the proto's defaults, as before.
    bare = convert.server_info_to_proto(
        ServerInfo("m", 64, 16, 0, 0, 0, 0.0, [], 20, 100, "fcfs", "recompute", 0, 0.0)
    )
    assert bare.max_loras == 0 and not bare.lora_adapters and bare.num_speculative_tokens == 0


def test_the_servicer_serves_each_features_rpcs():
    assert feature_rpcs() == {
        "LoadLoraAdapter": "lora",
        "UnloadLoraAdapter": "lora",
        "Embed": "pooling",
    }
    for method in feature_rpcs():
        assert getattr(SchedulerServicer, method).__name__ == method


def test_every_field_the_store_writes_of_its_own_is_a_base_field(redis_url):
    """decode_record takes a field outside BASE_FIELDS for a feature's: the store's own fields
    (optional ones included) must all be listed there, and a feature may not take one's name."""
    from scheduler_svc.state.records import BASE_FIELDS, FinishRecord, StoredRequest

    raw = redis.Redis.from_url(redis_url, decode_responses=True)

    async def write() -> None:
        store = RequestStore(redis_url)
        rec = StoredRequest("own", [1, 2], PARAMS, deadline=5.0, trace_context="00-ab-cd-01")
        await store.create(rec)
        finish = FinishRecord("own", 1, ["stop"], [None], error="")
        await store.write_step([], [finish], [("own", [None, [[3, -0.5]]])])
        bad = StoredRequest("bad", [1], PARAMS, features={"status": "x"})
        try:
            await store.create(bad)
        except ValueError as e:
            assert "status" in str(e)
        else:
            raise AssertionError("a feature field named like the record's own was stored")
        await store.close()

    asyncio.run(write())
    assert set(raw.hgetall("llmserve:request:own")) <= BASE_FIELDS
    assert not raw.exists("llmserve:request:bad")
    assert (
        decode_record(
            "own", {k.encode(): v.encode() for k, v in raw.hgetall("llmserve:request:own").items()}
        ).features
        == {}
    )
