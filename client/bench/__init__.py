"""Benchmark harness (issue 5): offline workloads, llmserve and HF backends, throughput and
serving modes, JSON + markdown reports. Entry points: `llmserve bench ...` and
`python -m client.bench ...`."""
