"""What the executor keeps per sequence between steps: its tokens, its sampling parameters,
its block table and how much of it is in the KV cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from executor_svc.runner.sampler import SamplingParams

__all__ = ["BlockTable", "SeqState"]


class BlockTable:
    """One sequence's device block ids, kept as a growable int32 array.

    Every step the runner copies the first n ids of each sequence into the batch's block-table
    tensor: from an array that is one memcpy, from a Python list a conversion per id, which at
    long contexts adds up to milliseconds a step. It offers what the servicer uses of a list.
    """

    __slots__ = ("_buf", "_len")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self._buf = np.zeros(max(16, 2 * len(ids)), dtype=np.int32)
        self._buf[: len(ids)] = ids
        self._len = len(ids)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: int | slice) -> int | np.ndarray:
        if isinstance(key, slice):
            return self._buf[: self._len][key]
        if not -self._len <= key < self._len:
            raise IndexError(f"block index {key} out of range [0, {self._len})")
        return int(self._buf[key % self._len])

    def __setitem__(self, key: int | slice, value: int | Sequence[int]) -> None:
        if isinstance(key, slice):
            if key != slice(None):
                raise TypeError("only table[:] = ids (replace the whole table) is supported")
            ids = list(value)  # type: ignore[arg-type]
            self._reserve(len(ids))
            self._buf[: len(ids)] = ids
            self._len = len(ids)
            return
        if not 0 <= key < self._len:
            raise IndexError(f"block index {key} out of range [0, {self._len})")
        self._buf[key] = value

    def extend(self, ids: Sequence[int]) -> None:
        n = len(ids)
        if n:
            self._reserve(self._len + n)
            self._buf[self._len : self._len + n] = ids
            self._len += n

    def _reserve(self, n: int) -> None:
        if n > len(self._buf):
            grown = np.zeros(max(n, 2 * len(self._buf)), dtype=np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown

    def tolist(self) -> list[int]:
        return self._buf[: self._len].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (BlockTable, list, tuple)) and self.tolist() == list(other)

    def __repr__(self) -> str:
        return f"BlockTable({self.tolist()})"


@dataclass(slots=True)
class SeqState:
    """One live sequence, created by a NewSequence and updated by every step that runs it.

    The executor's one owner of a sequence's state: the runner's ``ScheduledSequence`` is a
    per-step view of it (the same token list and block table, plus what features add for the
    step), ``StepPlan`` holds references to it, and the features' fields below are set by
    their hooks (``check_new``, ``record``) and by nothing else.
    """

    seq_id: str
    token_ids: list[int]  # prompt + outputs known so far; the executor appends what it samples
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_table: BlockTable  # physical device block ids in logical order
    num_computed_tokens: int  # tokens whose KV is in the cache
    # What features keep for the sequence, by feature name (features/*: each reads and writes
    # its own entry, in its hooks); None while no feature keeps anything. The runner's view
    # shares the dict (entries a step's view reads are set before the step is planned).
    features: dict[str, Any] | None = None
    # Overlapped steps (api/step.py Flight): (launched step, draw row, index in token_ids) of
    # the newest token sampled for it, which may still be PENDING in token_ids.
    pending: tuple[Any, int, int] | None = None
