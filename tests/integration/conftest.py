"""Fixtures shared by the integration tests that talk to one OpenAI frontend in front of the
`llmserve_stack` fixture (which such a module imports from tests.support.stack, or defines): each
module gets its own frontend, started with the flags of its `frontend_args` fixture."""

from __future__ import annotations

import pytest

from tests.support.frontend import openai_client, running_frontend

# Registered here, once for the folder: imported into each module instead, a session fixture is
# one per module (three SmolLM2 stacks alive to the end of the session).
from tests.support.smollm2 import smollm2_dir, smollm2_stack  # noqa: F401 - the fixtures


@pytest.fixture(scope="module")
def frontend_args() -> list[str]:
    """The frontend's flags beyond the scheduler's address; a module overrides this fixture."""
    return []


@pytest.fixture(scope="module")
def frontend(llmserve_stack, frontend_args, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("frontend")
    with running_frontend(workdir, llmserve_stack.address, *frontend_args) as fe:
        yield fe


@pytest.fixture(scope="module")
def oai(frontend):
    """The official openai client on the frontend (no retries: a failure must show)."""
    return openai_client(frontend)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id
