"""The executor's features, built once at start-up from its configuration, in the order their
hooks run (features/base.py).

Order matters twice: structured outputs check their masks before speculation checks that no
constrained sequence verifies proposals (``check_step``); prompt logprobs' LM-head passes come
before pooling's rows and the sampling pass, as the tensor-parallel workers expect. The
per-request features (structured outputs, speculation's verification, prompt logprobs,
pooling) are always on; LoRA and the draft model only with their configuration.
"""

from __future__ import annotations

from pathlib import Path

from executor_svc.features.base import Features
from executor_svc.features.lora.feature import Lora
from executor_svc.features.lora.manager import LoraConfig
from executor_svc.features.pooling.feature import Pooling
from executor_svc.features.prompt_logprobs.feature import PromptLogprobs
from executor_svc.features.spec.feature import SpecDecode
from executor_svc.features.structured.feature import StructuredOutput

__all__ = ["build_features"]


def build_features(
    *, lora: LoraConfig | None = None, speculative_model: str | Path | None = None
) -> Features:
    """``lora``: serve adapters (None: refuse them); ``speculative_model``: a draft checkpoint."""
    return Features(
        [
            StructuredOutput(),
            SpecDecode(speculative_model),
            Lora(lora),
            PromptLogprobs(),
            Pooling(),
        ]
    )
