"""llmserve scheduler service: queues, block tables, batching, preemption, the public API."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llmserve")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+local"
