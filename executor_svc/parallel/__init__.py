"""Tensor parallelism's collectives: the group of one executor's ranks, the split of a model's
heads over it (``group``). The sharded layers that use it live with the models
(``models/parallel_layers.py``, ``models/parallel_llama.py``); the step broadcast, the worker
ranks and rank 0's launcher with the runner (``runner/tp_*.py``)."""
