"""Item popularity from the train part of each sequence only.

Why only ``seq[:-2]``: the last two items of every user are the validation and test
targets.  Counting them would let popularity (used as a re-ranker feature and as the
retriever's padding) carry information about the very targets being evaluated.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from dgr2.data.split import train_part

NUM_BUCKETS = 10


def train_counts(sequences: Mapping[str, Sequence[str]], catalog: Iterable[str]) -> dict[str, int]:
    """Interactions of every catalog item within the train part of every sequence (0 if none)."""
    counter: Counter[str] = Counter()
    for seq in sequences.values():
        counter.update(train_part(seq))
    counts = {item: 0 for item in catalog}
    unknown = set(counter) - counts.keys()
    if unknown:
        raise ValueError(f"{len(unknown)} sequence items are not in the catalog, e.g. {sorted(unknown)[:3]}")
    counts.update(counter)
    return counts


def popularity_buckets(counts: Mapping[str, int]) -> dict[str, int]:
    """Decile bucket 0-9 of each item's train count over the catalog (0 = least popular).

    bucket = number of the nine decile boundaries that lie strictly below the item's count,
    so the least popular items are always bucket 0 and equal counts always share a bucket.
    Deciles of log-count and of count are the same (log is monotone), so no log is taken.
    With many tied low counts some middle buckets can be empty; that is kept rather than
    splitting equal items across buckets.
    """
    if not counts:
        return {}
    items = list(counts)
    values = np.array([counts[item] for item in items], dtype=np.float64)
    bounds = np.quantile(values, np.arange(1, NUM_BUCKETS) / NUM_BUCKETS)
    buckets = np.searchsorted(bounds, values, side="left")
    return {item: int(b) for item, b in zip(items, buckets)}


def popular_order(counts: Mapping[str, int]) -> list[str]:
    """Items most popular first; ties by item id so the order is total and reproducible."""
    return sorted(counts, key=lambda item: (-counts[item], item))
