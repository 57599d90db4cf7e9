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
