"""Executor command-line checks that need no model: core lists for --cpu-cores."""

import os

import pytest

from executor_svc.cli import main
from executor_svc.config.cpus import format_cpu_list, parse_cpu_list


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


def test_auto_cores_take_one_cpu_per_physical_core_and_leave_the_lowest():
    from executor_svc.config.cpus import auto_cores

    smt = {c: {c % 4, c % 4 + 4} for c in range(8)}  # 4 cores, 2 hyper-threads each
    assert auto_cores(set(range(8)), smt) == ({1, 2, 3}, 0)
    assert auto_cores({2, 3, 6, 7}, smt) == ({3}, 2)  # a cpuset of two cores
    assert auto_cores({5, 6}, smt) == ({6}, 5)  # the set's own CPU of each core
    assert auto_cores({0, 4}, smt) == ({0}, None)  # one core: kept
    no_smt = {c: {c} for c in range(16)}
    assert auto_cores(set(range(16)), no_smt) == (set(range(1, 16)), 0)


def test_siblings_read_sysfs_lists(tmp_path):
    from executor_svc.config.cpus import siblings

    for cpu, text in {0: "0,4\n", 1: "1-2\n"}.items():
        (tmp_path / f"cpu{cpu}/topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}/topology/thread_siblings_list").write_text(text)
    assert siblings({0, 1, 9}, tmp_path) == {0: {0, 4}, 1: {1, 2}, 9: {9}}
