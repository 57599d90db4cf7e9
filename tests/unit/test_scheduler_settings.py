"""The scheduler's configuration object: built once from its flags and its environment."""

from __future__ import annotations

from pathlib import Path

from scheduler_svc.flags import build_parser
from scheduler_svc.settings import SchedulerSettings

VARIABLES = (
    "REDIS_URL",
    "LLMSERVE_API_KEY",
    "LLMSERVE_REDIS_SENTINEL",
    "LLMSERVE_REDIS_SENTINEL_PASSWORD",
    "LLMSERVE_REDIS_MIN_REPLICAS",
)


def settings(argv: list[str]) -> SchedulerSettings:
    return SchedulerSettings.from_args(build_parser().parse_args(argv))


def test_no_redis_named_means_an_embedded_one(monkeypatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    s = settings(["--redis-dir", "/tmp/r", "--no-reflection", "--port", "0"])
    assert s.engine.redis_url == ""  # the CLI starts a loopback Redis and fills it in
    assert s.redis_dir == Path("/tmp/r")
    assert s.engine.executor_addresses == ["127.0.0.1:50061"]
    assert s.server.reflection is False and s.server.port == 0
    assert s.server.env_api_key == "" and s.server.tls is None


def test_the_environment_fills_what_no_flag_gave(monkeypatch) -> None:
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMSERVE_API_KEY", " k ")
    monkeypatch.setenv("LLMSERVE_REDIS_SENTINEL", "s1:26379,s2:26379")
    monkeypatch.setenv("LLMSERVE_REDIS_SENTINEL_PASSWORD", "pw")
    monkeypatch.setenv("LLMSERVE_REDIS_MIN_REPLICAS", "1")
    s = settings(["--executor", "e:1", "--max-num-seqs", "8"])
    assert s.server.env_api_key == "k"
    assert s.engine.redis_sentinels == (("s1", 26379), ("s2", 26379))
    assert s.engine.redis_url == "redis://"  # with Sentinels: only credentials, db and TLS
    assert s.engine.redis_sentinel_password == "pw"
    assert s.engine.redis_min_replicas == 1
    assert s.engine.executor_addresses == ["e:1"] and s.engine.max_num_seqs == 8
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere:6379/2")
    assert settings(["--redis-url", "redis://here:1"]).engine.redis_url == "redis://here:1"
    assert settings([]).engine.redis_url == "redis://elsewhere:6379/2"
