"""Multi-LoRA serving on the executor: PEFT adapters loaded from disk (``peft``), an LRU cache of
loaded adapters and the per-step adapter table (``manager``), and the batched apply that the
model's packed ``Linear`` layers call (``layers``)."""
