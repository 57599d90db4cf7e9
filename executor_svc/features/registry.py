"""The executor's features, built once at start-up from its configuration, in the order their
hooks run (features/base.py).

Order matters twice: a feature's ``check_step`` may rely on the checks of those before it
(features/spec: no constrained sequence verifies proposals, so the masks are checked first);
prompt logprobs' LM-head passes come before pooling's rows and the sampling pass, as the
tensor-parallel workers expect. The per-request features are always on; LoRA and a feature's
optional model part only with their configuration (``options``: each feature reads its own).
"""

from __future__ import annotations

from typing import Any

from executor_svc.features.base import Feature, Features
from executor_svc.features.lora.feature import Lora
from executor_svc.features.pooling.feature import Pooling
from executor_svc.features.prompt_logprobs.feature import PromptLogprobs
from executor_svc.features.spec.feature import SpecDecode
from executor_svc.features.structured.feature import StructuredOutput

__all__ = ["FEATURE_TYPES", "build_features", "feature_rpcs"]

FEATURE_TYPES: tuple[type[Feature], ...] = (
    StructuredOutput,
    SpecDecode,
    Lora,
    PromptLogprobs,
    Pooling,
)


def build_features(**options: Any) -> Features:
    """``options``: the runner's keyword arguments that configure a feature, by the name the
    feature reads (each type's ``build``; JSON-able ones as tensor-parallel workers get them)."""
    return Features(t.build(options) for t in FEATURE_TYPES)


def feature_rpcs() -> tuple[str, ...]:
    """The executor RPCs features serve (``Feature.rpcs``): the servicer routes each to its
    feature."""
    return tuple(m for t in FEATURE_TYPES for m in t.rpcs)
