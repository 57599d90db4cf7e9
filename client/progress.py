"""Progress bar for batch generation: finished requests, and input/output tokens per second."""

from __future__ import annotations

import time

from tqdm.auto import tqdm


class GenerateProgress:
    """Counts finished requests; the token rates are over wall time since the bar started, so
    they are what the whole batch achieved, not the last request."""

    def __init__(self, total: int, *, enabled: bool = True, desc: str = "Processed prompts"):
        self.enabled = enabled
        self.num_input_tokens = 0
        self.num_output_tokens = 0
        self._start = time.perf_counter()
        self._bar = (
            tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True) if enabled else None
        )

    def update(self, num_input_tokens: int, num_output_tokens: int) -> None:
        self.num_input_tokens += num_input_tokens
        self.num_output_tokens += num_output_tokens
        if self._bar is None:
            return
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.set_postfix_str(
            f"est. speed input: {self.num_input_tokens / elapsed:.2f} toks/s, "
            f"output: {self.num_output_tokens / elapsed:.2f} toks/s",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
