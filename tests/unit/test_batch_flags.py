"""The Batch API's flags, and the scheduler's Redis variables as their defaults."""

from __future__ import annotations

import pytest

from frontend_svc.batch.flags import batch_settings
from frontend_svc.cli import build_parser
from frontend_svc.config import FrontendConfig


def _settings(argv: list[str], env: dict[str, str]):
    return batch_settings(build_parser().parse_args(argv), env)


def test_off_without_redis_and_defaults():
    s = _settings([], {})
    assert not s.enabled and s.sentinels == () and s.min_replicas == 0
    assert (s.max_file_bytes, s.max_concurrency, s.priority) == (32 * 2**20, 16, -1)


def test_flags_win_over_the_schedulers_variables():
    env = {
        "LLMSERVE_REDIS_SENTINEL": "s1:26379,s2:26380",
        "LLMSERVE_REDIS_SENTINEL_MASTER": "prod",
        "LLMSERVE_REDIS_MIN_REPLICAS": "1",
        "LLMSERVE_REDIS_SENTINEL_PASSWORD": "pw",
    }
    s = _settings([], env)
    assert s.enabled and s.sentinels == (("s1", 26379), ("s2", 26380))
    assert (s.sentinel_master, s.min_replicas, s.sentinel_password) == ("prod", 1, "pw")
    s = _settings(
        ["--redis-sentinel", "h:1", "--redis-sentinel-master", "m", "--redis-min-replicas", "2",
         "--batch-max-file-mb", "1", "--batch-lease", "3"],
        env,
    )  # fmt: skip
    assert (s.sentinels, s.sentinel_master, s.min_replicas) == ((("h", 1),), "m", 2)
    assert (s.max_file_bytes, s.lease_s, s.poll_s) == (2**20, 3.0, 0.75)


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--batch-max-concurrency", "0"], {}),
        (["--redis-min-replicas", "-1"], {}),
        ([], {"LLMSERVE_REDIS_MIN_REPLICAS": "one"}),
        ([], {"LLMSERVE_REDIS_SENTINEL": "nohost"}),
    ],
)
def test_bad_settings_stop_the_server_with_a_message(argv, env):
    with pytest.raises(SystemExit) as e:
        _settings(argv, env)
    assert str(e.value)  # a sentence, not a traceback


def test_the_config_object_carries_them(monkeypatch):
    monkeypatch.setenv("LLMSERVE_REDIS_MIN_REPLICAS", "1")
    config = FrontendConfig.from_args(build_parser().parse_args(["--redis-url", "redis://r:1"]))
    assert config.batch.redis_url == "redis://r:1" and config.batch.min_replicas == 1
