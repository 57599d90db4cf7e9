"""Tensor parallelism inside one executor: the group and head split (``group``), sharded
layers and model (``layers``, ``model``), the step as rank 0 broadcasts it (``step``), the
worker ranks (``worker``) and rank 0's launcher and watchdog (``launcher``)."""
