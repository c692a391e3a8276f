"""Ranking metrics for one relevant item per request, and structural failure rates.

Why single-relevant formulas: each request has exactly one held-out next item (the
target), so recall@k is a hit indicator, NDCG@k reduces to ``1/log2(rank+2)`` (the
ideal DCG is 1) and MRR is ``1/(rank+1)`` with 0-based ranks.  A target outside the
candidate list (``target_index == -1``) or absent from the ranking is a miss everywhere,
so re-rankers are never credited for what the retriever did not recall.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from dgr2.eval.parse import ParsedRanking

DEFAULT_KS: tuple[int, ...] = (1, 3, 5, 10)
NOT_IN_LIST = -1


def target_rank(ranking: Sequence[int], target_index: int) -> int | None:
    """0-based position of the target's first occurrence in ``ranking``, None when absent."""
    target_index = _check_target(target_index)
    if target_index == NOT_IN_LIST:
        return None
    for position, candidate in enumerate(ranking):
        if candidate == target_index:
            return position
    return None


def recall_at_k(rank: int | None, k: int) -> float:
    """1.0 when the target sits in the top k, else 0.0."""
    return 1.0 if rank is not None and rank < _check_k(k) else 0.0


def ndcg_at_k(rank: int | None, k: int) -> float:
    """NDCG@k with one relevant item: ``1/log2(rank+2)`` inside the top k, else 0."""
    if rank is None or rank >= _check_k(k):
        return 0.0
    return 1.0 / math.log2(rank + 2)


def reciprocal_rank(rank: int | None) -> float:
    """``1/(rank+1)``, 0 when the target is absent (MRR is its mean)."""
    return 0.0 if rank is None else 1.0 / (rank + 1)


def example_metrics(
    ranking: Sequence[int], target_index: int, ks: Sequence[int] = DEFAULT_KS
) -> dict[str, float]:
    """All ranking metrics of one request (``recall@k``, ``ndcg@k`` for every k, ``mrr``)."""
    rank = target_rank(ranking, target_index)
    row: dict[str, float] = {}
    for k in ks:
        row[f"recall@{k}"] = recall_at_k(rank, k)
    for k in ks:
        row[f"ndcg@{k}"] = ndcg_at_k(rank, k)
    row["mrr"] = reciprocal_rank(rank)
    return row


def ranking_metrics(
    rankings: Sequence[Sequence[int]],
    target_indices: Sequence[int],
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, float]:
    """Mean of :func:`example_metrics` over requests (keys ``recall@k``, ``ndcg@k``, ``mrr``)."""
    if len(rankings) != len(target_indices):
        raise ValueError(f"{len(rankings)} rankings but {len(target_indices)} targets")
    if not rankings:
        raise ValueError("ranking_metrics needs at least one example")
    ks = tuple(_check_k(k) for k in ks)
    if not ks:
        raise ValueError("ks must name at least one cutoff")
    totals: dict[str, float] = {}
    for ranking, target in zip(rankings, target_indices):
        for name, value in example_metrics(ranking, target, ks).items():
            totals[name] = totals.get(name, 0.0) + value
    return {name: total / len(rankings) for name, total in totals.items()}


def structural_metrics(parsed: Sequence[ParsedRanking]) -> dict[str, float]:
    """Rates of each structural defect over raw outputs, before any repair.

    ``*_rate`` is the fraction of outputs with at least one such defect and
    ``mean_*`` the mean count per output.  An output with no parsable answer counts as
    a format error and also as missing every candidate (it names none of them).
    """
    if not parsed:
        raise ValueError("structural_metrics needs at least one parsed output")
    n = len(parsed)
    return {
        "valid_rate": sum(p.valid for p in parsed) / n,
        "format_error_rate": sum(p.format_error for p in parsed) / n,
        "duplicate_rate": sum(p.duplicates > 0 for p in parsed) / n,
        "missing_rate": sum(p.missing > 0 for p in parsed) / n,
        "out_of_set_rate": sum(p.out_of_set > 0 for p in parsed) / n,
        "mean_duplicates": sum(p.duplicates for p in parsed) / n,
        "mean_missing": sum(p.missing for p in parsed) / n,
        "mean_out_of_set": sum(p.out_of_set for p in parsed) / n,
    }


def _check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"cutoff k must be a positive int, got {k!r}")
    return k


def _check_target(target_index: int) -> int:
    if isinstance(target_index, bool):
        raise TypeError("target_index must be an int, got bool")
    try:
        value = operator.index(target_index)
    except TypeError:
        raise TypeError(f"target_index must be an int, got {type(target_index).__name__}") from None
    if value < NOT_IN_LIST:
        raise ValueError(f"target_index {value} < -1 (use -1 for 'not in the candidate list')")
    return value
