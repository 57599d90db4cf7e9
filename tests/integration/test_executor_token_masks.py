"""The executor's side of structured output: ExecuteModelRequest.token_masks is honoured by
greedy and seeded sampling, logprobs are reported after masking, and a bad mask is refused."""

from __future__ import annotations

import math
import zlib

import grpc
import numpy as np
import pytest

from protos import executor_pb2 as pb
from tests.support.executor_driver import ExecutorDriver, executor_channel, running_executor
from tests.support.model_factory import make_tiny_checkpoint

VOCAB = 512
PROMPT = [5, 17, 42, 99, 7]


def row(allowed: list[int], compressed: bool = True) -> tuple[bytes, bool]:
    bits = np.zeros(VOCAB, dtype=np.uint8)
    bits[allowed] = 1
    raw = np.packbits(bits, bitorder="little").tobytes()  # == little-endian uint32 words
    return (zlib.compress(raw), True) if compressed else (raw, False)


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    with running_executor(model_dir, device="cpu", dtype="float32", block_size=4) as (_, p):
        yield p


@pytest.fixture
def driver(port):
    with executor_channel(port) as stub:
        stub.Reset(pb.ResetRequest())
        yield ExecutorDriver(stub)


def first_token(driver: ExecutorDriver, params: pb.SamplingParams, allowed=None, **kw):
    """Prefill PROMPT and sample one token, with `allowed` as its mask (None: no mask)."""
    seq_id = f"s{driver.step_id}"
    driver.add(seq_id, PROMPT, params)
    req, num_scheduled = driver.build_request()
    if allowed is not None:
        payload, compressed = row(allowed, **kw)
        req.token_masks.add(seq_id=seq_id, bitmask=payload, compressed=compressed)
    resp = driver.stub.ExecuteModel(req)
    driver.commit(resp, num_scheduled)
    driver.finish(seq_id)
    (s,) = resp.sampled
    return s


@pytest.mark.parametrize("compressed", [True, False])
def test_greedy_takes_the_best_allowed_token_and_logprobs_renormalise(driver, compressed):
    free = first_token(driver, pb.SamplingParams(num_logprobs=5))
    top = [t.token_id for t in free.top_logprobs]
    raw = {t.token_id: t.logprob for t in free.top_logprobs}
    allowed = [top[1], top[3]]  # the best token is forbidden
    got = first_token(driver, pb.SamplingParams(num_logprobs=5), allowed, compressed=compressed)
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


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda m: setattr(m, "seq_id", "nobody"), "not run this step"),
        (lambda m: setattr(m, "bitmask", zlib.compress(b"\x00" * (VOCAB // 8))), "no token"),
        (lambda m: setattr(m, "bitmask", zlib.compress(b"\xff" * 8)), "expected 64"),
        (lambda m: setattr(m, "bitmask", b"junk"), "zlib"),
    ],
)
def test_bad_mask_is_invalid_argument(driver, mutate, needle):
    driver.add("bad", PROMPT, pb.SamplingParams())
    req, _ = driver.build_request()
    payload, compressed = row([1, 2])
    mask = req.token_masks.add(seq_id="bad", bitmask=payload, compressed=compressed)
    mutate(mask)
    with pytest.raises(grpc.RpcError) as e:
        driver.stub.ExecuteModel(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.details()
