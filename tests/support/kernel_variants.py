"""The ``use_variant`` fixture: a test loads one variant of the CPU kernel library.

Each variant is the same sources built with other ``-march`` flags (executor_svc/kernels/library.py);
a test runs one by forcing ``$LLMSERVE_CPU_ISA`` and reloading the library, and skips when this
CPU cannot run it. The default variant is loaded again after the test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from executor_svc.kernels import library


@pytest.fixture
def use_variant(monkeypatch) -> Iterator[Callable[[str], None]]:
    """``use_variant(name)`` loads the library's ``name`` variant for this test."""

    def use(name: str) -> None:
        if name not in library.supported_variants():
            pytest.skip(f"this CPU cannot run the {name} variant")
        monkeypatch.setenv("LLMSERVE_CPU_ISA", name)
        library.reset()
        assert library.variant() == name

    yield use
    monkeypatch.delenv("LLMSERVE_CPU_ISA", raising=False)
    library.reset()
