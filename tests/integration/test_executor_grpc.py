"""The executor over real gRPC on loopback, driven step by step like a scheduler would.

Reference: Hugging Face transformers on the same tiny random checkpoints (greedy `generate`, and
log_softmax of its logits).
"""

from __future__ import annotations

import copy
import random
import signal
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from executor_svc.kernels import library
from protos import executor_pb2 as pb
from protos import executor_pb2_grpc as pb_grpc
from tests.support.executor_driver import (
    ExecutorDriver,
    executor_channel,
    executor_subprocess,
    running_executor,
)
from tests.support.model_factory import load_hf_model, make_tiny_checkpoint

ARCHS = ["llama", "qwen2", "qwen3"]
VOCAB = 512
MAX_NEW = 8
BLOCK_SIZE = 4  # small blocks: every prompt crosses block boundaries
# Explicit pool sizes: no memory profiling, and a CPU pool of ~100 blocks instead of 1 GiB.
RUNNER_KWARGS = dict(
    device="cpu",
    dtype="float32",
    block_size=BLOCK_SIZE,
    num_device_blocks=192,
    swap_space_gib=0.0005,
    attention_backend="torch",
)
SERVICE = "llmserve.executor.v1.Executor"


def make_prompts(n: int = 9, seed: int = 0) -> dict[str, list[int]]:
    """Prompts of different lengths (1 .. 29 tokens), ids clear of the special 0..2."""
    rng = random.Random(seed)
    lengths = [1, 2, 5, 7, 10, 13, 17, 22, 29][:n]
    return {f"p{i}": [rng.randrange(3, VOCAB) for _ in range(n_)] for i, n_ in enumerate(lengths)}


PROMPTS = make_prompts()


class Served:
    """A running executor for one checkpoint plus its HF reference outputs (computed lazily)."""

    def __init__(self, model_dir: Path, port: int, server: object) -> None:
        self.model_dir = model_dir
        self.port = port
        self.server = server
        self._hf = None
        self._greedy: dict[str, list[int]] = {}

    @property
    def hf(self) -> torch.nn.Module:
        if self._hf is None:
            self._hf = load_hf_model(self.model_dir)
        return self._hf

    def hf_generate(self, prompt: list[int], **kwargs: object) -> list[int]:
        """HF greedy generate of MAX_NEW tokens (extra generate() arguments allowed)."""
        ids = torch.tensor([prompt])
        # No EOS: the reference must not stop early on the (random) EOS id.
        config = copy.deepcopy(self.hf.generation_config)
        config.eos_token_id = None
        out = self.hf.generate(
            ids,
            generation_config=config,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
            **kwargs,
        )
        tokens = out[0, ids.shape[1] :].tolist()
        assert len(tokens) == MAX_NEW
        return tokens

    def hf_greedy(self, seq_id: str) -> list[int]:
        if seq_id not in self._greedy:
            self._greedy[seq_id] = self.hf_generate(PROMPTS[seq_id])
        return self._greedy[seq_id]

    def hf_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """log_softmax of HF's logits at every position: [len(token_ids), vocab]."""
        with torch.no_grad():
            logits = self.hf(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module", params=ARCHS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model_dir = make_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    with running_executor(model_dir, **RUNNER_KWARGS) as (srv, port):
        yield Served(model_dir, port, srv)


@pytest.fixture
def driver(served: Served):
    with executor_channel(served.port) as stub:
        stub.Reset(pb.ResetRequest())
        yield ExecutorDriver(stub)


def assert_matches_hf(served: Served, outputs: dict[str, list[int]]) -> None:
    for seq_id, tokens in outputs.items():
        assert tokens == served.hf_greedy(seq_id), seq_id


# ------------------------------------------------------------------ equivalence with HF


def test_batched_greedy_matches_hf(served: Served, driver: ExecutorDriver) -> None:
    outputs = driver.generate(PROMPTS, MAX_NEW)
    assert_matches_hf(served, outputs)


def test_chunked_prefill_matches_hf(served: Served, driver: ExecutorDriver) -> None:
    # The 29-token prompt in chunks of 5 (crossing block boundaries at odd offsets), another in 3s;
    # the rest decode alongside while those two are still prefilling.
    chunk_sizes = {"p8": 5, "p6": 3}
    seen_steps_without_sample = []

    def before_step(i: int, d: ExecutorDriver) -> None:
        if i < 5:
            seen_steps_without_sample.append(len(d.seqs["p8"].outputs) == 0)

    outputs = driver.generate(PROMPTS, MAX_NEW, chunk_sizes=chunk_sizes, before_step=before_step)
    assert seen_steps_without_sample == [True] * 5  # non-final chunks sampled nothing
    assert_matches_hf(served, outputs)


def test_swap_out_and_in_matches_hf(served: Served, driver: ExecutorDriver) -> None:
    def before_step(i: int, d: ExecutorDriver) -> None:
        if i == 3:
            d.swap_out_seq("p4")
            d.swap_out_seq("p8")
        if i == 5:
            # Back into different device blocks than before; the executor relearns them in full.
            d.swap_in_seq("p4")
            d.swap_in_seq("p8")

    outputs = driver.generate(PROMPTS, MAX_NEW, before_step=before_step)
    assert_matches_hf(served, outputs)


def test_block_copy_matches_hf(served: Served, driver: ExecutorDriver) -> None:
    def before_step(i: int, d: ExecutorDriver) -> None:
        if i == 3:
            # The originals are freed after this step and reused by other sequences' new blocks
            # (lowest ids first), so a wrong copy or a missed replacement shows up as wrong tokens.
            d.copy_seq_blocks("p7")
            d.copy_seq_blocks("p2")

    outputs = driver.generate(PROMPTS, MAX_NEW, before_step=before_step)
    assert_matches_hf(served, outputs)


def test_logprobs_close_to_hf(served: Served, driver: ExecutorDriver) -> None:
    params = pb.SamplingParams(num_logprobs=5)
    prompts = {k: PROMPTS[k] for k in ("p1", "p5", "p8")}
    for seq_id, prompt in prompts.items():
        driver.add(seq_id, prompt, params)
    for _ in range(4):
        driver.step()
    for seq_id, prompt in prompts.items():
        seq = driver.seqs[seq_id]
        ref = served.hf_logprobs(seq.token_ids)  # [num_tokens, vocab]
        for k, s in enumerate(seq.outputs):
            row = ref[len(prompt) - 1 + k]
            assert s.token_id == int(row.argmax())
            assert s.logprob == pytest.approx(float(row[s.token_id]), abs=1e-3)
            top = [(t.token_id, t.logprob) for t in s.top_logprobs]
            assert len(top) == 5
            assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
            assert top[0][0] == s.token_id
            ref_top = torch.topk(row, 5)
            assert [t for t, _ in top] == ref_top.indices.tolist()
            assert [lp for _, lp in top] == pytest.approx(ref_top.values.tolist(), abs=1e-3)


def test_seeded_sampling_independent_of_batch(served: Served, driver: ExecutorDriver) -> None:
    seeded = pb.SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    prompt = PROMPTS["p5"]

    def run(others: dict[str, list[int]], chunk: int | None) -> list[int]:
        driver.add("seeded", prompt, seeded, chunk_size=chunk)
        for seq_id, p in others.items():
            driver.add(seq_id, p, pb.SamplingParams(temperature=0.8))  # unseeded noise
        while len(driver.seqs["seeded"].outputs) < 12:
            driver.step()
        out = driver.finish("seeded").output_token_ids
        for seq_id in others:
            driver.finish(seq_id)
        return out

    alone = run({}, None)
    crowded = run({k: PROMPTS[k] for k in ("p0", "p3", "p8")}, 4)
    assert alone == crowded
    other_seed = pb.SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    driver.add("other", prompt, other_seed)
    while len(driver.seqs["other"].outputs) < 12:
        driver.step()
    assert driver.finish("other").output_token_ids != alone


# ------------------------------------------------------------------ service surface


def test_describe(served: Served, driver: ExecutorDriver) -> None:
    info = driver.info
    assert len(info.instance_id) >= 16
    assert info.model_name == served.model_dir.name
    assert info.architecture.endswith("ForCausalLM")
    assert (info.dtype, info.device, info.attention_backend) == ("float32", "cpu", "torch")
    assert info.cpu_kernel_isa == library.variant()  # "" where no kernel library loads
    assert (info.block_size, info.num_device_blocks) == (BLOCK_SIZE, 192)
    assert info.num_cpu_blocks > 0
    assert (info.vocab_size, info.max_model_len) == (VOCAB, 512)
    assert list(info.eos_token_ids) == [2]
    assert info.max_logprobs == 20


def test_instance_id_changes_per_start(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "m", "llama")
    ids = []
    for _ in range(2):
        with running_executor(model_dir, **RUNNER_KWARGS) as (_, port), executor_channel(port) as s:
            ids.append(s.Describe(pb.DescribeRequest()).instance_id)
    assert ids[0] != ids[1]


def test_health_and_reflection(served: Served) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def test_health_not_serving_before_load(tmp_path: Path) -> None:
    from executor_svc.api.server import ExecutorServer

    srv = ExecutorServer(tmp_path / "nothing-loaded-yet", "127.0.0.1", 0)
    port = srv.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE)
            )
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.ExecutorStub(channel).Describe(pb.DescribeRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(0)


def test_get_tokenizer_without_tokenizer(served: Served, driver: ExecutorDriver) -> None:
    reply = driver.stub.GetTokenizer(pb.GetTokenizerRequest())
    # The factory writes no tokenizer; only the generation config (EOS ids) is there to send.
    assert [f.name for f in reply.files] == ["generation_config.json"]
    assert reply.tokenizer_class == ""  # AutoTokenizer finds nothing to load


PENALTY = 2.0  # the most the API allows


def test_repetition_penalty_in_a_mixed_batch_matches_hf(served: Served, driver: ExecutorDriver):
    """Penalised rows next to plain ones: the runner hands the sampler token lists only for
    the penalised rows, and their output still equals HF's generate(repetition_penalty=...)."""

    # Prompts that already hold the tokens greedy decoding wants next: the penalty has to bite.
    penalised = {k: PROMPTS[k] + served.hf_greedy(k)[:6] for k in ("p1", "p3", "p5")}
    for seq_id, prompt in penalised.items():
        driver.add(seq_id, prompt, pb.SamplingParams(repetition_penalty=PENALTY))
    plain = {k: v for k, v in PROMPTS.items() if k not in penalised}
    outputs = driver.generate(plain, MAX_NEW)
    changed = 0
    for seq_id, prompt in penalised.items():
        ref = served.hf_generate(prompt, repetition_penalty=PENALTY)
        assert driver.seqs[seq_id].token_ids[len(prompt) :][:MAX_NEW] == ref, seq_id
        changed += ref != served.hf_generate(prompt)
    assert changed  # the penalty really changed an output
    assert_matches_hf(served, outputs)


def test_decode_lane_gives_what_cached_sequences_give(served: Served, driver: ExecutorDriver):
    params = pb.SamplingParams(temperature=0.9, seed=5)
    prompts = {k: PROMPTS[k] for k in ("p1", "p2", "p3")}
    lane_sizes: list[int] = []

    def watch(i: int, d: ExecutorDriver) -> None:
        lane_sizes.append(len(d._lane_ids))

    with_lane = driver.generate(prompts, 6, params, before_step=watch)
    lane_logprobs = {k: [o.logprob for o in s.outputs] for k, s in driver.seqs.items()}
    driver.stub.Reset(pb.ResetRequest())
    plain = ExecutorDriver(driver.stub, decode_lane=False)
    assert plain.generate(prompts, 6, params) == with_lane
    assert {k: [o.logprob for o in s.outputs] for k, s in plain.seqs.items()} == pytest.approx(
        lane_logprobs
    )
    assert max(lane_sizes) == 3  # the lane really carried the decodes


def test_reset_drops_state(served: Served, driver: ExecutorDriver) -> None:
    for seq_id in ("p1", "p2", "p3"):
        driver.add(seq_id, PROMPTS[seq_id])
    driver.step()
    assert driver.stub.Reset(pb.ResetRequest()).num_dropped == 3
    req, _ = driver.build_request()
    with pytest.raises(grpc.RpcError) as err:
        driver.stub.ExecuteModel(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "decode_seq_ids[0]: unknown seq_id 'p1'" in err.value.details()
    assert driver.stub.Reset(pb.ResetRequest()).num_dropped == 0


# ------------------------------------------------------------------ steps sent ahead


def test_a_step_sent_ahead_runs_right_after_its_predecessor(
    served: Served, driver: ExecutorDriver
) -> None:
    """after_step_id: a step that arrives first still waits for the one it follows, and then
    decodes from the token that one sampled (the scheduler never sent it)."""
    driver.add("p1", PROMPTS["p1"])
    driver.step()  # the prompt; the executor holds p1 and its first token
    first, num_scheduled = driver.build_request()  # p1's next decode
    seq = driver.seqs["p1"]
    nc = seq.num_computed_tokens + 1  # once `first` ran
    ahead = pb.ExecuteModelRequest(step_id=first.step_id + 1, after_step_id=first.step_id)
    room = len(seq.block_table) * BLOCK_SIZE
    if nc < room:
        ahead.decode_seq_ids.append("p1")
        ahead.decode_num_computed_tokens.append(nc)
    else:
        new_block = driver._alloc(driver.free_device, 1)
        ahead.cached_sequences.add(
            seq_id="p1", new_block_ids=new_block, num_scheduled_tokens=1, num_computed_tokens=nc
        )
    later = driver.stub.ExecuteModel.future(ahead, timeout=60)
    time.sleep(0.3)
    assert not later.done(), "ran before the step it follows"
    resp = driver.stub.ExecuteModel(first)
    driver.commit(resp, num_scheduled)
    second = later.result()
    tokens = [*second.decode_token_ids, *(s.token_id for s in second.sampled)]
    assert driver.seqs["p1"].output_token_ids + tokens == served.hf_greedy("p1")[:3]

    # A step following one that failed (here: an unknown sequence) is refused, not run.
    bad = pb.ExecuteModelRequest(
        step_id=100, decode_seq_ids=["nope"], decode_num_computed_tokens=[3]
    )
    follow = pb.ExecuteModelRequest(step_id=101, after_step_id=100)
    follow_call = driver.stub.ExecuteModel.future(follow, timeout=60)
    with pytest.raises(grpc.RpcError) as err:
        driver.stub.ExecuteModel(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        follow_call.result()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "step 100, which this step follows, failed" in err.value.details()

    # One waiting for a step that never comes gives up at a Reset.
    orphan = driver.stub.ExecuteModel.future(
        pb.ExecuteModelRequest(step_id=201, after_step_id=200), timeout=60
    )
    time.sleep(0.2)
    driver.stub.Reset(pb.ResetRequest())
    with pytest.raises(grpc.RpcError) as err:
        orphan.result()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "reset" in err.value.details()

    # Callers that give up while waiting free the executor's threads at once (more of them
    # than it has threads: were they still held, Describe would get none).
    orphans = [
        driver.stub.ExecuteModel.future(
            pb.ExecuteModelRequest(step_id=401 + i, after_step_id=400 + i), timeout=60
        )
        for i in range(12)
    ]
    time.sleep(0.3)
    for call in orphans:
        call.cancel()
    assert driver.stub.Describe(pb.DescribeRequest(), timeout=10).block_size == BLOCK_SIZE


# ------------------------------------------------------------------ CLI


@pytest.mark.parametrize("cores", ["0", "auto"])
def test_cli_cpu_cores_pins_every_thread(tmp_path: Path, cores: str) -> None:
    from executor_svc.config import cpus

    # auto: one CPU per physical core of this process's set, the lowest core left out when
    # there are two or more (the unit tests hold the rule; here, that the CLI applies it).
    want = cpus.choose()[0] if cores == "auto" else {0}
    model_dir = make_tiny_checkpoint(tmp_path / "pinned", "llama")
    args = ["--device", "cpu", "--num-device-blocks", "16", "--swap-space", "0.001"]
    with (
        executor_subprocess(model_dir, tmp_path, *args, "--cpu-cores", cores) as (proc, port),
        executor_channel(port) as stub,
    ):
        driver = ExecutorDriver(stub, stub.Describe(pb.DescribeRequest()))
        assert len(driver.generate([[5, 6, 7]], 2)["seq-0"]) == 2
        tasks = list(Path(f"/proc/{proc.pid}/task").iterdir())
        assert len(tasks) > 1  # gRPC's threads too
        for task in tasks:
            status = (task / "status").read_text()
            allowed = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
            assert cpus.parse_cpu_list(allowed.split(":")[1]) == want, task


def test_cli_subprocess_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "cli-model", "qwen2")
    args = ["--device", "cpu", "--block-size", "8", "--num-device-blocks", "32"]
    args += ["--swap-space", "0.001", "--log-level", "debug"]
    with executor_subprocess(model_dir, tmp_path, *args) as (proc, port):
        with executor_channel(port) as stub:
            info = stub.Describe(pb.DescribeRequest())
            assert (info.architecture, info.block_size) == ("Qwen2ForCausalLM", 8)
            assert info.num_device_blocks == 32
            driver = ExecutorDriver(stub, info)
            out = driver.generate([[5, 6, 7]], 3)
            assert len(out["seq-0"]) == 3
            assert not info.draining
            driver.add("held", [8, 9, 10])
            driver.step()  # the executor now holds a sequence
            # SIGTERM drains: Describe and step replies say so while it still runs the
            # sequences it holds.
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not stub.Describe(pb.DescribeRequest()).draining:
                assert time.monotonic() < deadline, "never said it was draining"
                time.sleep(0.02)
            assert driver.step().draining
        # Nobody steps its sequence any more: it stops after the idle wait, not the 20 s drain.
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15
    log = (tmp_path / "executor.log").read_text()
    assert "executor.ready" in log and "step.done" in log
    assert "executor.draining" in log and "executor.drain.no_scheduler" in log


def test_cli_builds_and_serves_demo_model(tmp_path: Path) -> None:
    args = ["--device", "cpu", "--num-device-blocks", "16", "--swap-space", "0.001"]
    env = {"LLMSERVE_CACHE": str(tmp_path / "cache")}
    with (
        executor_subprocess("demo", tmp_path, *args, env=env) as (_, port),
        executor_channel(port) as stub,
    ):
        info = stub.Describe(pb.DescribeRequest())
        reply = stub.GetTokenizer(pb.GetTokenizerRequest())
        files = {f.name: f.content for f in reply.files}
    assert (info.model_name, info.architecture) == ("demo", "LlamaForCausalLM")
    (model_dir,) = (tmp_path / "cache").iterdir()  # built once, in the cache
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= files.keys()
    for name, content in files.items():
        assert content == (model_dir / name).read_bytes()
    assert "model.safetensors" not in files and "config.json" not in files
    # The class AutoTokenizer picks for the demo directory, named for the scheduler.
    assert reply.tokenizer_class.startswith("transformers.")
