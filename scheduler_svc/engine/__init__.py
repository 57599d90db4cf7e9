"""The engine: the asyncio layer around the scheduling core (see engine.py's docstring).

By role: the request path and the request state here; the executors in `fleet/`; what keeps it
serving through failures in `faults/` (tests/unit/test_import_graph.py keeps the floors apart).

Import from the modules (``engine.engine``, ``engine.config``, ``engine.client``): this file
imports nothing, so that the feature folders (scheduler_svc/features) may use the engine's
request state without an import circle through the package.
"""
