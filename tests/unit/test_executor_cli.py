"""Executor command-line checks that need no model: core lists for --cpu-cores."""

import os

import pytest

from executor_svc.cli import format_cpu_list, main, parse_cpu_list


def test_core_lists_parse_like_linux_cpusets():
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert parse_cpu_list(" 2 , 1-1") == {1, 2}
    assert format_cpu_list({8, 0, 1}) == "0,1,8"
    for bad in ("", "a", "1-", "-1", "3-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


@pytest.mark.parametrize(
    ("value", "needle"),
    [("x", "not a list of cores"), ("100000", "not available to this process")],
)
def test_unusable_core_lists_are_refused_before_anything_starts(value, needle, capsys):
    before = os.sched_getaffinity(0)
    with pytest.raises(SystemExit) as exc:
        main(["--model", "demo", "--cpu-cores", value])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize(
    ("env", "expected"), [(None, True), ("1", True), ("0", False), ("off", False)]
)
def test_step_invariant_numerics_default_on_and_env_turns_them_off(env, expected, monkeypatch):
    from executor_svc.config import numerics

    monkeypatch.setattr(numerics, "_enabled", None)  # read the environment again
    if env is None:
        monkeypatch.delenv("LLMSERVE_DETERMINISTIC", raising=False)
    else:
        monkeypatch.setenv("LLMSERVE_DETERMINISTIC", env)
    assert numerics.deterministic() is expected
    numerics.set_deterministic(not expected)
    assert numerics.deterministic() is (not expected)


def test_every_flag_lands_in_the_config_section_of_its_help_group(monkeypatch):
    """--help's groups are ExecutorConfig's sections: each flag of a group is a field of that
    section, and the config built from a command line carries what it said."""
    from dataclasses import fields

    from executor_svc.cli import build_parser
    from executor_svc.config.settings import SECTIONS, ExecutorConfig
    from executor_svc.features.flags import feature_sections

    parser = build_parser()
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for name, (section, _) in {**SECTIONS, **feature_sections()}.items():
        assert groups[name] <= {f.name for f in fields(section)}, name
    monkeypatch.setenv("LLMSERVE_REDIS_SENTINEL_PASSWORD", "s3cret")
    args = parser.parse_args(
        ["--block-size", "32", "--load-format", "dummy", "--no-deterministic", "--enable-lora"]
    )
    config = ExecutorConfig.from_args(args, feature_sections())
    assert config.cache.block_size == 32
    assert config.features["lora"].enable_lora is True
    assert config.registry.redis_sentinel_password == "s3cret"
    assert config.runtime.load_format == "dummy"
    assert config.runtime.deterministic is False
    assert config.runtime.enforce_eager is None  # not given: $LLMSERVE_ENFORCE_EAGER decides


def test_runtime_flags_win_over_the_environment_and_travel_as_json(monkeypatch):
    """What rank 0 hands its tensor-parallel workers instead of writing os.environ."""
    from executor_svc.config import envs

    monkeypatch.setenv("LLMSERVE_LOAD_FORMAT", "dummy")
    monkeypatch.setenv("LLMSERVE_ENFORCE_EAGER", "1")
    monkeypatch.setattr(envs, "_flags", envs.RuntimeFlags())
    assert envs.load_format() == "dummy" and envs.enforce_eager() is True
    flags = envs.RuntimeFlags(load_format="auto", enforce_eager=None, deterministic=False)
    envs.install(envs.RuntimeFlags.from_json(flags.to_json()))
    assert envs.runtime_flags() == flags
    assert envs.load_format() == "auto"
    assert envs.enforce_eager() is True  # not set by a flag: the variable still decides
    assert envs.deterministic() is False
