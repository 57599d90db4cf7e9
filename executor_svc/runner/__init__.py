"""One executor's model execution without gRPC: the ``ModelRunner`` and what it owns (KV cache,
sampler, loaded model), the flattened batch, and tensor parallelism's runtime (``tp_step``,
``tp_worker``, ``tp_launcher``)."""
