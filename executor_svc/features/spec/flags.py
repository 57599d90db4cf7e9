"""Speculative decoding's command line on the executor: ``--speculative-model`` (in the model
group; its value is ``ModelSettings.speculative_model``), its usage check, and what it hands
the server. ``SpecDecode.flags`` names this module; features/flags.py collects it."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_flags", "server_options", "usage_error"]


def add_flags(section: str, g: argparse._ArgumentGroup) -> None:
    if section == "model":
        g.add_argument(
            "--speculative-model",
            default=None,
            help="a draft checkpoint (same tokenizer, fewer layers) for the scheduler's "
            '--speculative-config \'{"method": "draft_model", ...}\'; not with TP > 1',
        )


def usage_error(config: Any) -> str | None:
    """``config``: the ``ExecutorConfig``."""
    if config.model.speculative_model and config.compute.tensor_parallel_size > 1:
        return "--speculative-model does not run with --tensor-parallel-size > 1 yet"
    return None


def server_options(config: Any) -> dict[str, Any]:
    """Keyword arguments of ``ExecutorServer`` (and so of its ``ModelRunner``)."""
    model = config.model
    return {"speculative_model": model.speculative_model} if model.speculative_model else {}
