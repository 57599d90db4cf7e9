"""The gRPC face of the executor: server, servicer, step validation and bookkeeping, the state
kept per sequence between steps, the Redis registry and metrics."""
