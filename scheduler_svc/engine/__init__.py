"""The engine: the asyncio layer around the scheduling core (see engine.py's docstring).

Import from the modules (``engine.engine``, ``engine.config``, ``engine.client``): this file
imports nothing, so that the feature folders (scheduler_svc/features) may use the engine's
request state without an import circle through the package.
"""
