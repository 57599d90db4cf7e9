"""The OpenAI-compatible frontend as a real process in front of a test stack's scheduler."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai

from tests.support.stack import _env, _wait_port_file, stop_process


@dataclass
class Frontend:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, workdir: Path, scheduler_address: str, *extra: str) -> Frontend:
        workdir.mkdir(parents=True, exist_ok=True)
        port_file = workdir / f"frontend-{time.monotonic_ns()}.port"
        log_path = workdir / "frontend.log"
        log = open(log_path, "ab")  # noqa: SIM115 - owned by the process
        cmd = [
            sys.executable, "-m", "frontend_svc", "--port", "0", "--port-file", str(port_file),
            "--scheduler", scheduler_address, "--log-level", "warning", *extra,
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=log)
        port = _wait_port_file(port_file, proc, 60, "frontend")
        return cls(proc, port, log_path)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"frontend not healthy within {timeout}s")

    def request(
        self, method: str, path: str, body: object = None, headers: dict | None = None
    ) -> tuple[int, object]:
        """A plain HTTP call (stdlib, no client library): (status, parsed JSON or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = body if isinstance(body, str | bytes) or body is None else json.dumps(body)
            hdrs = {"content-type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.read().decode()
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, raw
        finally:
            conn.close()

    def stream(self, path: str, body: dict, into: list[dict], timeout: float = 180) -> bool:
        """POST a streaming request (`"stream": true` is added) and append each `data:` event's
        JSON to `into` as it arrives, so that callers can watch it grow. True once `data: [DONE]`
        ended the stream; False when the connection ended without it (a broken stream). A status
        other than 200 raises AssertionError with the body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=json.dumps({**body, "stream": True}),
                         headers={"content-type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            if resp.status != 200:
                raise AssertionError(f"{path}: HTTP {resp.status}: {resp.read()[:500]!r}")
            while line := resp.readline():
                data = line.decode().strip()
                if not data.startswith("data:"):
                    continue  # blank separators, comments
                data = data[len("data:") :].strip()
                if data == "[DONE]":
                    return True
                into.append(json.loads(data))
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        stop_process(self.proc)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@contextlib.contextmanager
def running_frontend(workdir: Path, scheduler_address: str, *extra: str) -> Iterator[Frontend]:
    """A healthy frontend (started with the flags `extra`) for the body; stopped after it, and
    then its log must hold no traceback: a request that failed inside it shows as a test failure
    even when the HTTP answer looked right."""
    fe = Frontend.start(workdir, scheduler_address, *extra)
    try:
        fe.wait_healthy()
        yield fe
    finally:
        fe.stop()
        assert "Traceback" not in fe.log(), fe.log()


def openai_client(fe: Frontend, api_key: str = "unused") -> openai.OpenAI:
    """The official openai client on `fe` (no retries: a failure must show)."""
    return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=api_key, max_retries=0)
