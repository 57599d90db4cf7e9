"""What keeps the engine serving through failures: the lifecycle (leadership, start-up,
stopping), health, a failed step or executor, and recompute (recovery after a scheduler,
executor or Redis loss).

It acts on the fleet and on the request state (the request table and streams) it is handed;
the request front (requests, aborts, embeds, the step loop) calls it, never the other way.
"""
