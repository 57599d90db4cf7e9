"""The executors as the scheduler sees them: one handle each (connection, scheduler core,
state), the pool that finds, connects and retires them, the router that picks one for a new
request, and the step message each is sent.

Lowest floor of the engine: it imports nothing of the engine but its configuration
(`engine/config.py`), so the request path and the fault handling both build on it.
"""
