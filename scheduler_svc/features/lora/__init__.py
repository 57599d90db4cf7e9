"""LoRA adapters on the scheduler: the registry of adapter names (``registry``)."""
