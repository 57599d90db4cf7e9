"""Session-wide test set-up shared by every test module."""

import os

# Triton must see this before any @triton.jit decorator runs: without a CUDA device the kernels
# run in Triton's interpreter on the CPU.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
