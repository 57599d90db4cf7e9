"""Metrics of the local lm-eval tasks (lm-eval loads this module by path, from the task YAMLs)."""

from __future__ import annotations


def names_the_answer(doc: dict, results: list[str]) -> dict[str, float]:
    """1 when the reply contains the answer as a word, case aside."""
    words = results[0].lower().replace(".", " ").replace(",", " ").split()
    return {"acc": float(doc["answer"].lower() in words)}
