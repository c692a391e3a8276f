"""Reproduce the retriever-variant table in :mod:`dgr2.data.candidates` on the real data.

Kept apart from the retriever so the library module has no data-path or printing concerns.
Run: ``python -m dgr2.data.retriever_bench [data_dir]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dgr2.config import DEFAULT_DATA_DIR
from dgr2.data.candidates import SasRecRetriever, recall_at_k
from dgr2.data.loader import load_raw_dataset
from dgr2.data.split import leave_one_out


def compare_variants(folder: Path = DEFAULT_DATA_DIR, k: int = 10) -> dict[str, dict[str, float]]:
    """Validation and test recall@k (retriever list only) of each scoring variant."""
    raw = load_raw_dataset(folder)
    splits = leave_one_out(raw.sequences)
    pairs = {name: [(ex.history, ex.target) for ex in splits[name]] for name in ("valid", "test")}
    variants: list[tuple[str, SasRecRetriever]] = [
        ("last_item", SasRecRetriever(raw.similar, scoring="last_item")),
        ("round_robin", SasRecRetriever(raw.similar, scoring="round_robin")),
    ]
    for decay in (0.1, 0.3, 0.5, 0.7, 0.9):
        variants.append((f"weighted d={decay} reciprocal", SasRecRetriever(raw.similar, recency_decay=decay)))
        variants.append(
            (f"weighted d={decay} log", SasRecRetriever(raw.similar, recency_decay=decay, rank_weight="log"))
        )
    return {name: {s: recall_at_k(r, pairs[s], k) for s in ("valid", "test")} for name, r in variants}


def main() -> None:
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DATA_DIR
    for name, recall in compare_variants(folder).items():
        print(f"{name:28s} valid R@10 {recall['valid']:.4f}   test R@10 {recall['test']:.4f}")


if __name__ == "__main__":
    main()
