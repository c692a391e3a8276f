"""Non-learned re-rankers every model is compared against.

Why these three: retriever order is what the re-ranker must beat (and the strict
fallback for invalid outputs), popularity is the classic strong non-personal baseline,
and random is the floor that shows what a metric gives for free with K candidates.
Random rankings are seeded per (seed, example index), so a result never depends on
evaluation order or batch size.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from dgr2.eval.examples import example_candidates, example_target
from dgr2.eval.metrics import DEFAULT_KS, ranking_metrics
from dgr2.eval.parse import check_num_candidates

BASELINES: tuple[str, ...] = ("retriever", "popularity", "random")


def retriever_ranking(num_candidates: int) -> list[int]:
    """The candidate list as the retriever ordered it (the identity ranking)."""
    return list(range(check_num_candidates(num_candidates)))


def popularity_ranking(
    candidates: Sequence[Hashable], item_counts: Mapping[Hashable, int]
) -> list[int]:
    """Candidates by train-split interaction count, descending; ties keep retriever order.

    Items absent from ``item_counts`` count 0 (never seen in training).
    """
    check_num_candidates(len(candidates))
    counts = [item_counts.get(item, 0) for item in candidates]
    return sorted(range(len(candidates)), key=lambda i: (-counts[i], i))


def random_ranking(num_candidates: int, seed: int, example_index: int) -> list[int]:
    """A uniform random permutation that depends only on ``(seed, example_index)``."""
    check_num_candidates(num_candidates)
    entropy = [_non_negative(seed, "seed"), _non_negative(example_index, "example_index")]
    rng = np.random.default_rng(entropy)
    return [int(i) for i in rng.permutation(num_candidates)]


def baseline_rankings(
    examples: Sequence[Mapping[str, Any]], item_counts: Mapping[Hashable, int], seed: int
) -> dict[str, list[list[int]]]:
    """Rankings of every baseline for every example, keyed by baseline name."""
    rankings: dict[str, list[list[int]]] = {name: [] for name in BASELINES}
    for position, example in enumerate(examples):
        candidates = example_candidates(example, position)
        rankings["retriever"].append(retriever_ranking(len(candidates)))
        rankings["popularity"].append(popularity_ranking(candidates, item_counts))
        rankings["random"].append(random_ranking(len(candidates), seed, position))
    return rankings


def baseline_metrics(
    examples: Sequence[Mapping[str, Any]],
    item_counts: Mapping[Hashable, int],
    seed: int,
    ks: Sequence[int] = DEFAULT_KS,
) -> dict[str, dict[str, float]]:
    """Ranking metrics of every baseline: ``{name: {metric: value}}``."""
    targets = [example_target(example, position) for position, example in enumerate(examples)]
    return {
        name: ranking_metrics(rankings, targets, ks)
        for name, rankings in baseline_rankings(examples, item_counts, seed).items()
    }


def _non_negative(value: int, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
