"""Every compiled CPU kernel (``csrc/``), their one builder and loader (``library``), and the thin
wrappers of the non-attention kernels (``gemm``, ``sampling``, ``elementwise``); the attention
kernel's wrapper is the CPU attention backend, ``attention/cpu_ops.py``."""
