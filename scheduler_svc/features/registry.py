"""The scheduler's features, built once at start-up from the engine's configuration, in the
order their hooks run (features/base.py).

Order matters once: a request's taker is chosen by ``admit`` in this order, and a constrained
request's grammar check wraps whatever was chosen before it (a prompt-only request ends without
one). Prompt logprobs, structured outputs, LoRA names, embeddings and deadlines are per request
and always on; a feature with a ``build`` decides from the configuration whether it is on.

Also listed here, so that nothing else names a feature: the modules that declare features'
command-line flags (``FEATURE_FLAGS``, read by features/flags.py) and the public RPCs features
serve (``feature_rpcs``, read by the servicer).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from scheduler_svc.engine.config import EngineConfig
from scheduler_svc.features.base import Feature, Features
from scheduler_svc.features.deadlines.feature import Deadlines
from scheduler_svc.features.lora import flags as lora_flags
from scheduler_svc.features.lora.feature import Lora
from scheduler_svc.features.pooling.embeds import EmbedRequests
from scheduler_svc.features.pooling.feature import Pooling
from scheduler_svc.features.prompt_logprobs.feature import PromptLogprobs
from scheduler_svc.features.spec import flags as spec_flags
from scheduler_svc.features.spec.feature import SpecDecode
from scheduler_svc.features.structured.feature import StructuredOutput
from scheduler_svc.state.store import RequestStore

__all__ = ["FEATURE_FLAGS", "FEATURE_TYPES", "build_features", "feature_rpcs"]

FEATURE_TYPES: tuple[type[Feature], ...] = (
    PromptLogprobs,
    StructuredOutput,
    Lora,
    Pooling,
    Deadlines,
    SpecDecode,
)
# The features' flag modules (add_flags, settings: their sections of EngineConfig.features;
# optionally add_launch_flags, launch_args), in --help order.
FEATURE_FLAGS: tuple[ModuleType, ...] = (spec_flags, lora_flags)


def build_features(
    config: EngineConfig,
    *,
    lifecycle: Any,
    pool: Any,
    model: Any,
    table: Any,
    store: RequestStore,
    persister: Any,
    check_available: Callable[[], None],
) -> Features:
    """The engine's parts a feature may use are handed in (the lifecycle, the executor pool, the
    model's info, the request table, the store, the persister) and nothing else."""
    embeds = EmbedRequests(config, lifecycle, pool, model, table.usage, check_available)
    features: list[Feature] = [
        PromptLogprobs(),
        StructuredOutput(model, table.handles),
        Lora.build(config, pool, store, check_available),
        Pooling(embeds),
        Deadlines(config.request_timeout_s, table, persister),
    ]
    optional = (SpecDecode.build(config, pool),)
    return Features([*features, *(f for f in optional if f is not None)])


def feature_rpcs() -> dict[str, str]:
    """The public RPCs features serve (``Feature.rpcs``), each to its feature's name."""
    return {method: t.name for t in FEATURE_TYPES for method in t.rpcs}
