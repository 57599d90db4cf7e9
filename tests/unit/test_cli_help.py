"""The services' `--help`: every flag in a group named for its concern, and every variable that
the service's config module reads named beside them (issue 43: configuration in one place)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from executor_svc.cli import build_parser as executor_parser
from frontend_svc.cli import build_parser as frontend_parser
from scheduler_svc.cli import build_parser as scheduler_parser

ROOT = Path(__file__).resolve().parents[2]
# parser, the config module whose variables it documents, variables that are not its to show
PARSERS = {
    "executor": (executor_parser, "executor_svc/config/envs.py", set()),
    # LLMSERVE_MODEL is the local launcher's (scheduler_svc/local/launch.py), not the server's.
    "scheduler": (scheduler_parser, "scheduler_svc/envs.py", {"LLMSERVE_MODEL"}),
    # The frontend reads the client's variables; OPENAI_API_KEY is the benchmark's.
    "frontend": (frontend_parser, "client/envs.py", {"OPENAI_API_KEY"}),
}


def variables_read(path: Path) -> set[str]:
    return set(re.findall(r'os\.environ\.get\("([A-Z_]+)"', path.read_text()))


@pytest.mark.parametrize("service", sorted(PARSERS))
def test_every_flag_is_in_a_group_of_its_concern(service: str) -> None:
    parser = PARSERS[service][0]()
    loose = [
        a.option_strings
        for g in parser._action_groups
        if g.title in ("options", "optional arguments", "positional arguments")
        for a in g._group_actions
        if a.dest != "help"
    ]
    assert not loose, f"{service}: flags outside a group: {loose}"
    assert len(parser._action_groups) >= 4


@pytest.mark.parametrize("service", sorted(PARSERS))
def test_help_names_every_variable_of_the_config_module(service: str) -> None:
    make, module, not_ours = PARSERS[service]
    names = {n for n in variables_read(ROOT / module) if n.startswith(("LLMSERVE_", "REDIS_"))}
    assert names, module
    text = make().format_help()
    missing = sorted(n for n in names - not_ours if n not in text)
    assert not missing, f"{service} --help does not name {missing}"
