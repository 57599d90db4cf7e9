"""Speculative decoding's command line: the scheduler's ``--speculative-config`` (its section
of the engine's configuration, ``EngineConfig.features["spec_decode"]``: a ``SpeculativeConfig``
or None), and the local launcher's, which also hands a draft model's
checkpoint to the executor (``--speculative-model``). Registered through ``features/registry.py``'s ``FEATURE_FLAGS``."""

from __future__ import annotations

import argparse
from typing import Any

from scheduler_svc.features.spec.decode import SpeculativeConfig

__all__ = ["add_flags", "add_launch_flags", "launch_args", "settings", "speculative_executor_args"]


def add_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help='speculative decoding, off by default; JSON like {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}, or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (the executors '
        "then need --speculative-model PATH). Outputs (greedy and seeded) are unchanged; only "
        "the speed changes",
    )


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The feature's section of the engine's configuration (``EngineConfig.features``)."""
    return {"spec_decode": args.speculative_config}


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative-config",
        default=None,
        help="the scheduler's --speculative-config; a draft_model's checkpoint is also passed to "
        "the executor (--speculative-model)",
    )


def launch_args(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """What the launcher adds to the executor's and to the scheduler's command lines."""
    if not args.speculative_config:
        return [], []
    executor = speculative_executor_args(args.speculative_config)
    return executor, ["--speculative-config", args.speculative_config]


def speculative_executor_args(speculative_config: str | None) -> list[str]:
    """The executor's share of a ``--speculative-config``: a draft model's checkpoint."""
    if not speculative_config:
        return []
    try:
        config = SpeculativeConfig.from_json(speculative_config)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"--speculative-config: {e}") from None
    return ["--speculative-model", config.model] if config.uses_draft else []
