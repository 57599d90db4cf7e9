"""The offline demo checkpoint (``demo_model``: random Llama weights and a locally trained BPE),
built outside the serving path; ``--model demo`` and the tests and benchmarks use it."""
