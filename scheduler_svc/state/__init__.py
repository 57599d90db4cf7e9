"""Request state in Redis: the store (every Redis access of the scheduler) and the persister
(writes each step in order, releases it to clients once acknowledged)."""
