"""The frontend's configuration object: built once from its flags and the client's variables,
the flags winning; --help groups its flags by concern."""

from __future__ import annotations

from pathlib import Path

from frontend_svc.cli import build_parser
from frontend_svc.config import FrontendConfig


def test_the_environment_gives_the_defaults_and_flags_win(monkeypatch) -> None:
    monkeypatch.setenv("LLMSERVE_ADDRESS", "sched:6000")
    monkeypatch.setenv("LLMSERVE_API_KEY", " k1 ")
    monkeypatch.setenv("LLMSERVE_TLS_CA", "/etc/ca.pem")
    config = FrontendConfig.from_args(build_parser().parse_args([]))
    assert (config.scheduler, config.env_api_key, config.scheduler_tls_ca) == (
        "sched:6000",
        "k1",
        "/etc/ca.pem",
    )
    args = ["--scheduler", "a:1,b:2", "--scheduler-tls-ca", "/x.pem", "--resume-timeout", "5"]
    config = FrontendConfig.from_args(build_parser().parse_args(args))
    assert config.scheduler == "a:1,b:2"
    assert config.scheduler_tls_ca == "/x.pem"
    assert config.resume_timeout_s == 5.0


def test_without_variables_the_documented_defaults_hold(monkeypatch) -> None:
    for name in ("LLMSERVE_ADDRESS", "LLMSERVE_API_KEY", "LLMSERVE_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    config = FrontendConfig.from_args(build_parser().parse_args(["--port-file", "p"]))
    assert config.scheduler == "127.0.0.1:50051"
    assert config.env_api_key is None and config.scheduler_tls_ca is None
    assert config.port_file == Path("p") and config.port == 8000


def test_help_groups_the_flags_and_names_the_variables() -> None:
    parser = build_parser()
    titles = [g.title for g in parser._action_groups]
    assert {"server", "scheduler", "auth", "tools"} <= set(titles)
    text = parser.format_help()
    for name in ("LLMSERVE_ADDRESS", "LLMSERVE_API_KEY", "LLMSERVE_TLS_CA"):
        assert name in text
