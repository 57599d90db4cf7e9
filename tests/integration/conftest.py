"""Fixtures shared by the integration tests that talk to one OpenAI frontend in front of the
`llmserve_stack` fixture (which such a module imports from tests.support.stack): each module gets
its own frontend."""

from __future__ import annotations

import openai
import pytest

from tests.support.frontend import Frontend

# Registered here, once for the folder: imported into each module instead, a session fixture is
# one per module (three SmolLM2 stacks alive to the end of the session).
from tests.support.smollm2 import smollm2_dir, smollm2_stack  # noqa: F401 - the fixtures


@pytest.fixture(scope="module")
def frontend(llmserve_stack, tmp_path_factory):
    fe = Frontend.start(tmp_path_factory.mktemp("frontend"), llmserve_stack.address)
    try:
        fe.wait_healthy()
        yield fe
    finally:
        fe.stop()
        assert "Traceback" not in fe.log(), fe.log()


@pytest.fixture(scope="module")
def oai(frontend):
    """The official openai client on the frontend (no retries: a failure must show)."""
    return openai.OpenAI(base_url=f"{frontend.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id
