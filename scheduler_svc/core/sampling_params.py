"""The scheduler's sampling parameters: the one model shared with the client (protos/sampling.py,
where the fields, vLLM's defaults, the validation, the proto conversion and the stored form
live), re-exported here under the names the scheduler has always used.

The core holds it as a plain dataclass and never calls its proto conversion (api/convert.py
does); importing it loads no wire types.
"""

from protos.sampling import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    ValidationError,
)

__all__ = [
    "LOGIT_BIAS_LIMIT",
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_LEN",
    "MAX_STOP_TOKEN_IDS",
    "SamplingParams",
    "ValidationError",
]
