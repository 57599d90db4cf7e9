"""The scheduling core: requests, queues, blocks and the policy, for one executor.

Plain synchronous, deterministic Python: no grpc, redis, asyncio, torch or protos (a test
checks). The engine wraps it; its tests feed it hand-built outputs and assert exact schedules.
"""
