"""The engine: the asyncio layer around the scheduling core (see engine.py's docstring).

By role: the request path and the request state here; the executors in `fleet/`; what keeps it
serving through failures in `faults/` (tests/unit/test_import_graph.py keeps the floors apart).
"""

from scheduler_svc.engine.client import EngineClient
from scheduler_svc.engine.config import EngineConfig, GenerateInput
from scheduler_svc.engine.engine import Engine

__all__ = ["Engine", "EngineClient", "EngineConfig", "GenerateInput"]
