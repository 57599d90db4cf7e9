"""The one way to start a local stack (scheduler_svc/local/launch.py), which `make run` runs and
the client's offline `LLM` runs as a command: the client (its benchmark harness included) imports
nothing of the services, and the launcher refuses what it cannot start. Starting a stack through
it is tests/integration/test_offline_llm.py's job."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_svc import cli as scheduler_cli
from scheduler_svc.local import launch
from tests.unit.test_import_graph import GRAPH

SERVICES = {"scheduler_svc", "executor_svc", "frontend_svc"}


def test_the_client_imports_no_service() -> None:
    client = {m: deps for m, deps in GRAPH.items() if m.split(".")[0] == "client"}
    assert {"client.offline", "client.bench.cli"} <= set(client)  # the harness is checked too
    found = [(m, d) for m, deps in client.items() for d in deps if d.split(".")[0] in SERVICES]
    assert not found, f"the client imports the services: {found}"


def test_a_frontend_needs_a_fixed_scheduler_port(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        launch.main(["--model", "demo", "--scheduler-port", "0"])
    assert exited.value.code == 2
    assert "the frontend needs a fixed --scheduler-port" in capsys.readouterr().err


def test_the_schedulers_extra_flags_win_over_the_launchers_own() -> None:
    """What the offline LLM relies on: its --port-file and log level reach the scheduler, and a
    caller's flag overrides the launcher's default for it."""
    args = launch.build_parser().parse_args(
        ["--scheduler-port", "0", "--frontend-port", "0", "--log-level", "warning",
         "--scheduler-arg=--port-file=/tmp/p", "--scheduler-arg=--redis-dir=/tmp/r"]
    )  # fmt: skip
    sched = scheduler_cli.build_parser().parse_args(launch.scheduler_argv(args, 5, []))
    assert sched.executor == ["127.0.0.1:5"] and sched.port == 0
    assert str(sched.port_file) == "/tmp/p" and sched.redis_dir == Path("/tmp/r")
    assert sched.log_level == "warning"
