"""The engine: the asyncio layer around the scheduling core (see engine.py's docstring)."""

from scheduler_svc.engine.client import EngineClient
from scheduler_svc.engine.config import EngineConfig, GenerateInput
from scheduler_svc.engine.engine import Engine

__all__ = ["Engine", "EngineClient", "EngineConfig", "GenerateInput"]
