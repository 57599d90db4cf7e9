"""KV transfer between executors (issue 47, first slice): the payload (payload.py), the
transports that move its bytes (transport.py: the interface and gRPC; shm.py: one host), an
executor's end of ExportKV / ImportKV (endpoint.py) and a caller that pipes one executor's
export into another's import (client.py). See docs/internals.md, "KV transfer"."""
