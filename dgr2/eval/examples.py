"""Validation of the evaluation example records shared by scoring and baselines.

Why one place: every scorer reads the same two fields of an example dict
(``candidates``, the retriever-ordered candidate items, and ``target_index``, the
0-based position of the held-out item in them or -1 when the retriever missed it), and a
malformed record must fail loudly with its position rather than skew a metric.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any

from dgr2.eval.parse import check_num_candidates


def example_candidates(example: Mapping[str, Any], position: int) -> Sequence[Any]:
    """The candidate list of one example, checked to be non-empty and within the grammar."""
    if not isinstance(example, Mapping):
        raise TypeError(f"example {position} must be a mapping, got {type(example).__name__}")
    if "candidates" not in example:
        raise KeyError(f"example {position} has no 'candidates'")
    candidates = example["candidates"]
    if isinstance(candidates, (str, bytes)) or not hasattr(candidates, "__len__"):
        raise TypeError(f"example {position}: 'candidates' must be a sequence of items")
    try:
        check_num_candidates(len(candidates))
    except ValueError as error:
        raise ValueError(f"example {position}: {error}") from None
    return candidates


def example_target(example: Mapping[str, Any], position: int) -> int:
    """The target index of one example, checked to lie in ``-1..K-1``."""
    candidates = example_candidates(example, position)
    if "target_index" not in example:
        raise KeyError(f"example {position} has no 'target_index'")
    raw = example["target_index"]
    if isinstance(raw, bool):
        raise TypeError(f"example {position}: 'target_index' must be an int, got bool")
    try:
        target = operator.index(raw)
    except TypeError:
        raise TypeError(
            f"example {position}: 'target_index' must be an int, got {type(raw).__name__}"
        ) from None
    if not -1 <= target < len(candidates):
        raise ValueError(
            f"example {position}: target_index {target} outside -1..{len(candidates) - 1}"
        )
    return target
