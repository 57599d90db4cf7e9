"""Benchmark harness for users (issue 5): offline workloads, llmserve and HF backends, throughput
and serving modes, JSON + markdown reports. Entry points: `llmserve bench ...` and
`python -m client.bench ...`. It talks to llmserve through the public API only, like any client;
the developer scripts that time the internals live in benchmarks/ (benchmarks/README.md)."""
