"""KV transfer between two real executors (issue 47, first slice): ExportKV on A, ImportKV on B,
both gRPC servers on loopback.

A prefills and decodes some sequences, its blocks move to other block ids on B, and B continues
them: B's tokens and logprobs equal A's undisturbed continuation bit for bit (fp32 CPU steps are
step-invariant). Also: the bytes each transport moves are the cache's bytes, a corrupted
payload is refused with the destination unchanged, and bad input gets a clear status.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
import torch

from executor_svc.kv_transfer.client import block_lists, move_kv, retarget
from executor_svc.kv_transfer.shm import shm_dir
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from scheduler_svc.engine.fleet.executor_handle import ExecutorHandle
from scheduler_svc.engine.fleet.kv_move import move_kv as scheduler_move_kv
from scheduler_svc.engine.fleet.kv_move import push_kv
from tests.support.executor_driver import (
    DriverSeq,
    ExecutorDriver,
    executor_channel,
    running_executor,
)
from tests.support.model_factory import make_tiny_checkpoint
from tests.support.prom import free_port

NUM_BLOCKS = 64
KWARGS = dict(
    device="cpu", dtype="float32", block_size=4, num_device_blocks=NUM_BLOCKS, compute_thread=True
)
PROMPTS = {"a": [11 + i for i in range(9)], "b": [40, 41, 42], "c": [100 + i for i in range(14)]}
PARAMS = {
    "a": pb.SamplingParams(num_logprobs=2),
    "b": pb.SamplingParams(temperature=0.8, seed=7),
    "c": pb.SamplingParams(),
}
TRANSPORTS = {"grpc": pb.KV_TRANSPORT_GRPC, "shm": pb.KV_TRANSPORT_SHM}


class End:
    """One executor: its server (for the cache's tensors) and a stub."""

    def __init__(self, srv, stub, port: int) -> None:
        self.srv, self.stub, self.port = srv, stub, port
        self.info = stub.Describe(pb.DescribeRequest())

    @property
    def cache(self):
        return self.srv.servicer.runner.kv_cache

    def blocks(self, ids: list[int]) -> torch.Tensor:
        """The K and V bytes of ``ids``, [2, num_layers, len(ids), ...] as int32 bits."""
        idx = torch.tensor(ids)
        return torch.stack([self.cache.key[:, idx], self.cache.value[:, idx]]).view(torch.int32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    with (
        running_executor(model_dir, **KWARGS) as (srv_a, port_a),
        running_executor(model_dir, **KWARGS) as (srv_b, port_b),
        executor_channel(port_a) as stub_a,
        executor_channel(port_b) as stub_b,
    ):
        yield End(srv_a, stub_a, port_a), End(srv_b, stub_b, port_b)


@pytest.fixture
def ends(pair):
    a, b = pair
    for end in pair:
        end.stub.Reset(pb.ResetRequest())
        end.cache.key.zero_()
        end.cache.value.zero_()
    return a, b


def run_a(a: End, num_steps: int) -> ExecutorDriver:
    d = ExecutorDriver(a.stub, a.info)
    for seq_id, prompt in PROMPTS.items():
        d.add(seq_id, prompt, PARAMS[seq_id])
    for _ in range(num_steps):
        d.step()
    return d


def high_blocks(d: ExecutorDriver, n: int) -> list[int]:
    """``n`` ids from the top of a driver's free list (A's come from the bottom)."""
    d.free_device.sort()
    taken, d.free_device[:] = d.free_device[-n:][::-1], d.free_device[:-n]
    return taken


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_moved_sequences_continue_bit_identical(ends, transport: str):
    a, b = ends
    da = run_a(a, num_steps=4)  # prefill + 3 decodes
    db = ExecutorDriver(b.stub, b.info)
    src = {k: list(s.block_table) for k, s in da.seqs.items()}
    dst = {k: high_blocks(db, len(v)) for k, v in src.items()}
    reply = move_kv(
        a.stub,
        b.stub,
        src,
        dst,
        transport=TRANSPORTS[transport],
        src_instance_id=a.info.instance_id,
        dst_instance_id=b.info.instance_id,
    )
    assert reply.num_blocks == sum(len(v) for v in src.values())
    moved = {
        k: DriverSeq(
            k,
            list(s.token_ids),
            s.num_prompt_tokens,
            s.params,
            block_table=dst[k],
            num_computed_tokens=s.num_computed_tokens,
        )
        for k, s in da.seqs.items()
    }
    db.seqs.update(moved)
    num_before = {k: len(s.outputs) for k, s in da.seqs.items()}
    for _ in range(6):
        da.step()
        db.step()
    for k in PROMPTS:
        undisturbed = [s.SerializeToString() for s in da.seqs[k].outputs[num_before[k] :]]
        continued = [s.SerializeToString() for s in db.seqs[k].outputs]
        assert len(continued) == 6 and continued == undisturbed, k
    assert da.seqs["a"].outputs[-1].top_logprobs  # logprobs were compared too


def test_without_the_move_the_continuation_differs(ends):
    """The control: B continuing on blocks that never received A's KV gives other tokens."""
    a, b = ends
    da = run_a(a, num_steps=4)
    db = ExecutorDriver(b.stub, b.info)
    for k, s in da.seqs.items():
        db.seqs[k] = DriverSeq(
            k,
            list(s.token_ids),
            s.num_prompt_tokens,
            s.params,
            block_table=high_blocks(db, len(s.block_table)),
            num_computed_tokens=s.num_computed_tokens,
        )
    num_before = {k: len(s.outputs) for k, s in da.seqs.items()}
    for _ in range(4):
        da.step()
        db.step()
    assert any(
        db.seqs[k].output_token_ids != da.seqs[k].output_token_ids[num_before[k] :] for k in PROMPTS
    )


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_each_transport_moves_the_cache_bytes(ends, transport: str):
    a, b = ends
    a.cache.key.normal_()
    a.cache.value.normal_()
    src = {"x": [5, 2, 9], "y": [30]}
    dst = {"x": [60, 0, 17], "y": [3]}
    exported = list(
        a.stub.ExportKV(
            pb.ExportKVRequest(
                sequences=block_lists(src), transport=TRANSPORTS[transport], chunk_bytes=1000
            )
        )
    )
    header = exported[0].header
    assert header.dtype == "float32" and header.transport == TRANSPORTS[transport]
    num_layers, _, block_size, heads, head_dim = a.cache.key.shape
    assert list(header.shape) == [num_layers, 2, 4, block_size, heads, head_dim]
    assert header.num_bytes == 4 * num_layers * 2 * 4 * block_size * heads * head_dim
    if transport == "grpc":
        assert len(exported) == -(-header.num_bytes // 1000)
        data = b"".join(c.data for c in exported)
        want = torch.stack([a.cache.key[:, [5, 2, 9, 30]], a.cache.value[:, [5, 2, 9, 30]]], 1)
        assert data == want.contiguous().numpy().tobytes()  # layer-major: [L, K/V, blocks, ...]
    else:
        assert len(exported) == 1 and not exported[0].data
        assert header.shm_reuse  # kept for reuse
        assert (shm_dir() / header.shm_name).stat().st_size == header.num_bytes
    before = b.blocks(list(range(NUM_BLOCKS)))
    b.stub.ImportKV(retarget(iter(exported), block_lists(dst), b.info.instance_id))
    assert torch.equal(b.blocks([60, 0, 17, 3]), a.blocks([5, 2, 9, 30]))
    after = b.blocks(list(range(NUM_BLOCKS)))
    untouched = [i for i in range(NUM_BLOCKS) if i not in (60, 0, 17, 3)]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])
    if transport == "shm":  # imported once: the segment is handed back to the exporter
        assert not (shm_dir() / header.shm_name).exists()
        assert (shm_dir() / (header.shm_name + ".free")).exists()


def test_shared_memory_segments_are_reused(ends):
    """The exporter's next payload goes into the segment the importer handed back (the same
    file: its pages are not allocated again), grown when it is longer; an importer that removes
    the segment (an older build: no shm_reuse) costs the exporter that segment only."""
    a, b = ends
    a.cache.key.normal_()
    a.cache.value.normal_()

    def move(src: list[int], dst: list[int], reuse: bool = True) -> int:
        (chunk,) = _export(a, {"x": src}, pb.KV_TRANSPORT_SHM)
        assert chunk.header.shm_reuse
        inode = (shm_dir() / chunk.header.shm_name).stat().st_ino
        chunk.header.shm_reuse = reuse
        b.stub.ImportKV(retarget(iter([chunk]), block_lists({"x": dst}), ""))
        assert torch.equal(b.blocks(dst), a.blocks(src))
        assert (shm_dir() / (chunk.header.shm_name + ".free")).exists() == reuse
        return inode

    first = move([1, 2, 3], [10, 11, 12])
    assert move([4], [13]) == first  # shorter: the same file, truncated
    assert move([5, 6, 7, 8, 9], [14, 15, 16, 17, 18]) == first  # longer: grown
    move([20], [21], reuse=False)  # removed by the importer
    move([22, 23], [24, 25])  # a segment of the pool again


def _expect(code: grpc.StatusCode, call, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    details = err.value.details()
    assert "Traceback" not in details
    for w in words:
        assert w in details, details


def _export(end: End, src: dict, transport: int = pb.KV_TRANSPORT_GRPC) -> list[pb.KVChunk]:
    req = pb.ExportKVRequest(sequences=block_lists(src), transport=transport, chunk_bytes=512)
    return list(end.stub.ExportKV(req))


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_corrupted_payload_is_refused_and_changes_nothing(ends, transport: str):
    a, b = ends
    a.cache.key.normal_()
    b.cache.value.normal_()
    chunks = _export(a, {"x": [1, 2]}, TRANSPORTS[transport])
    if transport == "grpc":
        chunks[1].data = bytes([chunks[1].data[0] ^ 1]) + chunks[1].data[1:]
    else:
        path = shm_dir() / chunks[0].header.shm_name
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0x40
        path.write_bytes(bytes(raw))
    before = b.blocks(list(range(NUM_BLOCKS)))
    dst = block_lists({"x": [7, 8]})
    _expect(
        grpc.StatusCode.DATA_LOSS,
        lambda: b.stub.ImportKV(retarget(iter(chunks), dst, "")),
        "CRC-32",
        "unchanged",
    )
    assert torch.equal(b.blocks(list(range(NUM_BLOCKS))), before)
    if transport == "shm":
        assert not (shm_dir() / chunks[0].header.shm_name).exists()


def test_bad_exports_get_clear_statuses(ends):
    a, _ = ends
    bad = grpc.StatusCode.INVALID_ARGUMENT
    _expect(bad, lambda: _export(a, {"x": [3, NUM_BLOCKS]}), "block id 64", "out of range")
    _expect(bad, lambda: _export(a, {"x": [3], "y": [3]}), "block id 3", "twice")
    _expect(bad, lambda: _export(a, {}), "no source blocks")
    _expect(bad, lambda: _export(a, {"x": [1]}, transport=9), "unknown KV transport")
    req = pb.ExportKVRequest(sequences=block_lists({"x": [1]}), instance_id="gone")
    _expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: list(a.stub.ExportKV(req)), "gone")


def test_move_kv_reports_the_exports_own_status(ends):
    a, b = ends
    _expect(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: move_kv(a.stub, b.stub, {"x": [1, NUM_BLOCKS]}, {"x": [1, 2]}),
        "block id 64",
    )


def relay(
    a: End, b: End, src: dict, dst: dict, transport: int | str, epoch: int = 0, dst_port: int = 0
) -> pb.ImportKVResponse:
    """The scheduler's relay (scheduler_svc/engine/fleet/kv_move.py, asyncio) between the two,
    each reached as the scheduler reaches an executor (an ExecutorHandle); `transport` "push":
    A pushes to B (at `dst_port` when given) itself, the scheduler only asks."""

    async def run() -> pb.ImportKVResponse:
        handles = []
        for end, port in ((a, a.port), (b, dst_port or b.port)):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            stub = pb_grpc.ExecutorStub(channel)
            handles.append(ExecutorHandle(f"127.0.0.1:{port}", channel, stub, end.info, None))
        try:
            if transport == "push":
                return await push_kv(*handles, src, dst, timeout_s=30, epoch=epoch)
            kind = TRANSPORTS[transport] if isinstance(transport, str) else transport
            return await scheduler_move_kv(
                *handles, src, dst, transport=kind, timeout_s=30, epoch=epoch
            )
        finally:
            for h in handles:
                await h.channel.close()

    return asyncio.run(run())


@pytest.mark.parametrize("transport", [*TRANSPORTS, "push"])
def test_the_scheduler_relay_moves_the_cache_bytes(ends, transport: str):
    a, b = ends
    a.cache.key.normal_()
    a.cache.value.normal_()
    src, dst = {"x": [5, 2, 9], "y": [30]}, {"x": [60, 0, 17], "y": [3]}
    reply = relay(a, b, src, dst, transport)
    assert reply.num_blocks == 4
    assert torch.equal(b.blocks([60, 0, 17, 3]), a.blocks([5, 2, 9, 30]))


@pytest.mark.parametrize("transport", ["grpc", "push"])
def test_the_scheduler_relay_reports_either_ends_status(ends, transport: str):
    a, b = ends
    _expect(  # the export's own status, not the import's cancellation it caused
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: relay(a, b, {"x": [1, NUM_BLOCKS]}, {"x": [1, 2]}, transport),
        "source block id 64",
    )
    _expect(  # the import's refusal
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: relay(a, b, {"x": [1]}, {"x": [NUM_BLOCKS]}, transport),
        "destination block id 64",
    )


def test_a_push_to_a_dead_destination_is_unavailable(ends):
    """B gone (nothing listens at its address): A's PushKV answers UNAVAILABLE, naming it, and
    stays usable (the move's caller falls back to recomputing)."""
    a, b = ends
    dead = free_port()
    _expect(
        grpc.StatusCode.UNAVAILABLE,
        lambda: relay(a, b, {"x": [1]}, {"x": [7]}, "push", dst_port=dead),
        f"push to 127.0.0.1:{dead}",
    )
    assert relay(a, b, {"x": [1]}, {"x": [7]}, "push").num_blocks == 1
    assert torch.equal(b.blocks([7]), a.blocks([1]))


@pytest.mark.parametrize("transport", ["grpc", "push"])
@pytest.mark.parametrize("end", ["source", "destination"])
def test_a_deposed_leader_moves_nothing(ends, end: str, transport: str):
    """Both ends check the mover's leadership epoch as they check a step's: a scheduler that
    lost its lease cannot write into a cache its successor (epoch 5 here) now owns."""
    a, b = ends
    fenced = a if end == "source" else b
    fenced.srv.servicer.leader_epoch = 5  # what a Reset of the newer leader leaves behind
    before = b.blocks([7])
    try:
        _expect(
            grpc.StatusCode.FAILED_PRECONDITION,
            lambda: relay(a, b, {"x": [1]}, {"x": [7]}, transport, epoch=4),
            "leadership epoch 4 is older than 5",
        )
        assert torch.equal(b.blocks([7]), before)
        assert relay(a, b, {"x": [1]}, {"x": [7]}, transport, epoch=5).num_blocks == 1
    finally:
        fenced.srv.servicer.leader_epoch = 0


def test_bad_imports_get_clear_statuses(ends, tmp_path: Path):
    a, b = ends
    bad = grpc.StatusCode.INVALID_ARGUMENT
    good = _export(a, {"x": [1, 2]})

    def send(chunks: list[pb.KVChunk], dst: dict | None = None, instance: str = ""):
        dst_lists = block_lists(dst if dst is not None else {"x": [5, 6]})
        return lambda: b.stub.ImportKV(retarget(iter(chunks), dst_lists, instance))

    def edited(**fields) -> list[pb.KVChunk]:
        chunks = [pb.KVChunk.FromString(c.SerializeToString()) for c in good]
        for k, v in fields.items():
            if isinstance(v, list):
                del getattr(chunks[0].header, k)[:]
                getattr(chunks[0].header, k).extend(v)
            else:
                setattr(chunks[0].header, k, v)
        return chunks

    _expect(bad, lambda: b.stub.ImportKV(iter([pb.KVChunk(data=b"x")])), "KVHeader")
    _expect(bad, send(good, {"x": [5, NUM_BLOCKS + 3]}), "destination block id 67")
    _expect(bad, send(good, {"x": [5]}), "1 destination blocks", "payload of 2")
    shape = list(good[0].header.shape)
    _expect(bad, send(edited(shape=[shape[0] + 1, *shape[1:]])), "does not match")
    _expect(bad, send(edited(dtype="bfloat16")), "does not match")
    _expect(bad, send(edited(dtype="int8")), "dtype")
    _expect(bad, send(good[:-1]), "the stream ended after")
    _expect(bad, send([good[0], good[2], *good[3:]]), "expected 512")
    _expect(grpc.StatusCode.FAILED_PRECONDITION, send(good, instance="other"), "other")
    shm = _export(a, {"x": [1, 2]}, pb.KV_TRANSPORT_SHM)
    name = shm[0].header.shm_name

    def shm_edited(**fields) -> list[pb.KVChunk]:
        chunk = pb.KVChunk.FromString(shm[0].SerializeToString())
        for k, v in fields.items():
            setattr(chunk.header, k, v)
        return [chunk]

    _expect(grpc.StatusCode.FAILED_PRECONDITION, send(shm_edited(host_id="x")), "another host")
    _expect(bad, send(shm_edited(shm_name="../../etc/passwd")), "not a KV segment name")
    _expect(bad, send([*shm, good[1]]), "one chunk")
    # A destination block that a live sequence holds.
    db = ExecutorDriver(b.stub, b.info)
    db.add("live", [3, 4, 5])
    db.step()
    live_block = db.seqs["live"].block_table[0]
    _expect(bad, send(shm, {"x": [9, live_block]}), f"block {live_block}", "'live'")
    # Every refusal left the segment for a retry where it could; a good import consumes it.
    b.stub.ImportKV(retarget(iter(shm), block_lists({"x": [9, 10]}), ""))
    assert not (shm_dir() / name).exists()


def test_steps_and_kv_copies_run_on_the_compute_thread(ends, monkeypatch):
    """A CPU executor loads, steps and copies KV on its one compute thread (api/compute.py),
    whichever gRPC thread took the call: one OpenMP pool in the process, not one per thread."""
    from executor_svc.api.service import ExecutorServicer
    from executor_svc.kv_transfer import endpoint

    ran: dict[str, set[str]] = {"step": set(), "gather": set(), "scatter": set()}

    def spy(kind: str, fn):
        def call(*args):
            ran[kind].add(threading.current_thread().name)
            return fn(*args)

        return call

    monkeypatch.setattr(ExecutorServicer, "_launch", spy("step", ExecutorServicer._launch))
    monkeypatch.setattr(endpoint, "gather", spy("gather", endpoint.gather))
    monkeypatch.setattr(endpoint, "scatter", spy("scatter", endpoint.scatter))
    a, b = ends
    # Steps from several client threads at once (each on its own sequences and blocks), so
    # that gRPC hands them to several of its threads.
    da = ExecutorDriver(a.stub, a.info)
    drivers = [da, *(ExecutorDriver(a.stub, a.info) for _ in range(2))]
    for i, d in enumerate(drivers):
        d.free_device[:] = d.free_device[i::3]
        d.add(f"t{i}", PROMPTS["a"], PARAMS["c"])
    threads = [threading.Thread(target=lambda d=d: [d.step() for _ in range(4)]) for d in drivers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    db = ExecutorDriver(b.stub, b.info)
    src = {"t0": list(da.seqs["t0"].block_table)}
    move_kv(
        a.stub,
        b.stub,
        src,
        {"t0": high_blocks(db, len(src["t0"]))},
        src_instance_id=a.info.instance_id,
        dst_instance_id=b.info.instance_id,
    )
    compute = {a.srv.compute.thread_name}
    assert compute == {b.srv.compute.thread_name} != {""}
    assert ran == {"step": compute, "gather": compute, "scatter": compute}
    assert all(len(d.seqs[f"t{i}"].outputs) == 4 for i, d in enumerate(drivers))
