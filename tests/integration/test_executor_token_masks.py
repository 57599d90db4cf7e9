"""The executor's side of structured output: ExecuteModelRequest.token_masks is honoured by
greedy and seeded sampling, logprobs are reported after masking, and a bad mask is refused."""

from __future__ import annotations

import math
import zlib

import grpc
import numpy as np
import pytest

from protos import executor_pb2 as pb
from tests.support.executor_driver import (
    ExecutorDriver,
    executor_channel,
    executor_subprocess,
    running_executor,
)
from tests.support.model_factory import make_tiny_checkpoint

VOCAB = 512
PROMPT = [5, 17, 42, 99, 7]


def row(allowed: list[int]) -> bytes:
    bits = np.zeros(VOCAB, dtype=np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").tobytes()  # == little-endian uint32 words


def set_masks(req: pb.ExecuteModelRequest, masks: dict[str, list[int]]) -> None:
    """One row per sequence, sent as TokenMasks (distinct rows, one zlib stream)."""
    order = [n.seq_id for n in req.new_sequences] + [c.seq_id for c in req.cached_sequences]
    order += list(req.decode_seq_ids)
    rows: list[bytes] = []
    for seq_id, allowed in masks.items():
        r = row(allowed)
        if r not in rows:
            rows.append(r)
        req.token_masks.seq_positions.append(order.index(seq_id))
        req.token_masks.row_index.append(rows.index(r))
    req.token_masks.rows = zlib.compress(b"".join(rows))


TP2_ARGS = [
    "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-device-blocks", "192",
    "--swap-space", "0.0005", "--attention-backend", "torch", "--tensor-parallel-size", "2",
    "--cpu-threads", "1",
]  # fmt: skip


@pytest.fixture(scope="module", params=["tp1", "tp2"])
def port(request, tmp_path_factory):
    """One executor, and one of two tensor-parallel ranks (rank 0 samples, so it alone reads
    the masks; the other rank never needs them)."""
    tmp = tmp_path_factory.mktemp(request.param)
    model_dir = make_tiny_checkpoint(tmp / "model", "llama", num_key_value_heads=2)
    if request.param == "tp1":
        with running_executor(model_dir, device="cpu", dtype="float32", block_size=4) as (_, p):
            yield p
    else:
        with executor_subprocess(model_dir, tmp, *TP2_ARGS) as (_, p):
            yield p


@pytest.fixture
def driver(port):
    with executor_channel(port) as stub:
        stub.Reset(pb.ResetRequest())
        yield ExecutorDriver(stub)


def first_token(driver: ExecutorDriver, params: pb.SamplingParams, allowed=None):
    """Prefill PROMPT and sample one token, with `allowed` as its mask (None: no mask)."""
    seq_id = f"s{driver.step_id}"
    driver.add(seq_id, PROMPT, params)
    req, num_scheduled = driver.build_request()
    if allowed is not None:
        set_masks(req, {seq_id: allowed})
    resp = driver.stub.ExecuteModel(req)
    driver.commit(resp, num_scheduled)
    driver.finish(seq_id)
    (s,) = resp.sampled
    return s


def test_greedy_takes_the_best_allowed_token_and_logprobs_renormalise(driver):
    free = first_token(driver, pb.SamplingParams(num_logprobs=5))
    top = [t.token_id for t in free.top_logprobs]
    raw = {t.token_id: t.logprob for t in free.top_logprobs}
    allowed = [top[1], top[3]]  # the best token is forbidden
    got = first_token(driver, pb.SamplingParams(num_logprobs=5), allowed)
    assert got.token_id == top[1]
    norm = math.log(math.exp(raw[top[1]]) + math.exp(raw[top[3]]))
    assert got.logprob == pytest.approx(raw[top[1]] - norm, abs=1e-4)
    finite = {t.token_id: t.logprob for t in got.top_logprobs if math.isfinite(t.logprob)}
    assert set(finite) == set(allowed)


def test_seeded_sampling_stays_inside_the_mask(driver):
    free = first_token(driver, pb.SamplingParams(num_logprobs=5))
    allowed = [t.token_id for t in free.top_logprobs[1:]]  # likely enough to be drawn
    seen = set()
    for seed in range(24):
        params = pb.SamplingParams(temperature=1.5, seed=seed)
        seen.add(first_token(driver, params, allowed).token_id)
    assert seen <= set(allowed) and len(seen) > 1
    # Seeded and masked is still reproducible.
    params = pb.SamplingParams(temperature=1.5, seed=5)
    assert (
        first_token(driver, params, allowed).token_id
        == first_token(driver, params, allowed).token_id
    )


def test_one_row_serves_several_sequences(driver):
    free = first_token(driver, pb.SamplingParams(num_logprobs=5))
    allowed = [t.token_id for t in free.top_logprobs[2:4]]
    for seq_id in ("p", "q"):
        driver.add(seq_id, PROMPT, pb.SamplingParams())
    driver.add("free", PROMPT, pb.SamplingParams())
    req, num_scheduled = driver.build_request()
    set_masks(req, {"p": allowed, "q": allowed})
    assert len(zlib.decompress(req.token_masks.rows)) == VOCAB // 8  # one row
    resp = driver.stub.ExecuteModel(req)
    driver.commit(resp, num_scheduled)
    by_id = {s.seq_id: s.token_id for s in resp.sampled}
    assert by_id["p"] == by_id["q"] == allowed[0]
    assert by_id["free"] == free.token_id  # an unconstrained batch mate is untouched


def _mask_fields(**fields):
    def mutate(tm: pb.TokenMasks) -> None:
        for k, v in fields.items():
            if isinstance(v, list):
                del getattr(tm, k)[:]
                getattr(tm, k).extend(v)
            else:
                setattr(tm, k, v)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (_mask_fields(seq_positions=[1]), "past the 1 sequences"),
        (_mask_fields(seq_positions=[0, 0], row_index=[0, 0]), "appears twice"),
        (_mask_fields(rows=zlib.compress(bytes(VOCAB // 8))), "no token"),
        (_mask_fields(rows=zlib.compress(b"\xff" * 8)), "64-byte rows"),
        (_mask_fields(rows=b"junk"), "zlib"),
        (_mask_fields(row_index=[3]), "past"),
        (_mask_fields(row_index=[]), "entries"),
    ],
)
def test_bad_mask_is_invalid_argument(driver, mutate, needle):
    driver.add("bad", PROMPT, pb.SamplingParams())
    req, _ = driver.build_request()
    set_masks(req, {"bad": [1, 2]})
    mutate(req.token_masks)
    with pytest.raises(grpc.RpcError) as e:
        driver.stub.ExecuteModel(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
