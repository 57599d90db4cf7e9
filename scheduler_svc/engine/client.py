"""What the API layer may ask of the engine: the whole of it, as one narrow interface.

The gRPC servicer (scheduler_svc/api) talks to this and to nothing else of the engine; the
engine's request front (`requests.RequestFront`) is what implements it.
"""

from __future__ import annotations

from typing import Any, Protocol

from protos import scheduler_pb2 as pb
from scheduler_svc.engine.config import AbortOutcome, GenerateInput, ServerInfo
from scheduler_svc.engine.streams import RequestHandle, RequestView

__all__ = ["EngineClient"]


class EngineClient(Protocol):
    @property
    def max_model_len(self) -> int: ...

    async def submit(self, inp: GenerateInput) -> tuple[RequestHandle, bool]:
        """The request's stream state, and whether this call created it (False: attached to
        an existing request with the same id; never a second generation)."""
        ...

    async def attach(self, req_id: str) -> RequestHandle:
        """A running or stored request's stream state (Resume)."""
        ...

    async def abort(self, req_id: str, *, missing_ok: bool = False) -> AbortOutcome:
        """Returns once the outcome is final and in Redis (engine/aborts.py)."""
        ...

    async def get_request(self, req_id: str) -> RequestView: ...

    def server_info(self) -> ServerInfo: ...

    async def move_request(self, req_id: str, to_executor: str) -> tuple[str, str]:
        """Admin: move a running request with its KV cache to the executor of that address or
        instance id; the addresses it ran on and runs on now (engine/moves.py)."""
        ...

    async def tokenize(self, inp: GenerateInput) -> list[int]: ...

    def detokenize(
        self, token_ids: list[int], skip_special_tokens: bool
    ) -> tuple[str, list[str]]: ...

    def feature(self, name: str) -> Any:
        """The named feature (features/<name>/feature.py; None when it is not built), for the
        RPCs only it serves (its ``serve``, features/base.py)."""
        ...

    def request_features(self, msg: pb.GenerateRequest) -> dict[str, Any]:
        """The features' fields of a Generate call (``GenerateInput.features``), each read by
        its feature's ``from_request`` hook."""
        ...
