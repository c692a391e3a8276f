"""Explicit, counted repair of a parsed ranking into a full permutation of the candidates.

Why separate from parsing: serving must always return a complete ranking, but a repaired
ranking hides model failures, so repair is a distinct step whose every edit is counted
and whose metrics are reported apart from the strict ones.

Rules: keep the first occurrence of each in-set label, drop repeats and out-of-set
tokens (the parser already excluded those from ``ranking``), then append the candidates
the model never named in descending model score (ties, or no scores: candidate order).
An output with no parsable answer names nobody, so it becomes the score/candidate order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dgr2.eval.parse import ParsedRanking


@dataclass(frozen=True)
class RepairResult:
    """A complete ranking plus what was changed to get it.

    ``repaired`` is True whenever the parsed output was not valid, even if the edits left
    the label order unchanged (e.g. junk after ``</answer>``): the output needed repair.
    """

    ranking: list[int]
    repaired: bool
    removed_duplicates: int
    dropped_out_of_set: int
    appended_missing: int


def repair_ranking(
    parsed: ParsedRanking, candidate_scores: Sequence[float] | None = None
) -> RepairResult:
    """Turn ``parsed`` into a permutation of ``range(num_candidates)``, counting every edit."""
    k = parsed.num_candidates
    order = fill_order(k, candidate_scores)
    kept: list[int] = []
    seen: set[int] = set()
    for index in parsed.ranking:
        if not 0 <= index < k:
            raise ValueError(f"parsed ranking holds index {index} outside 0..{k - 1}")
        if index not in seen:
            seen.add(index)
            kept.append(index)
    appended = [index for index in order if index not in seen]
    return RepairResult(
        ranking=kept + appended,
        repaired=not parsed.valid,
        removed_duplicates=len(parsed.ranking) - len(kept),
        dropped_out_of_set=parsed.out_of_set,
        appended_missing=len(appended),
    )


def fill_order(num_candidates: int, candidate_scores: Sequence[float] | None) -> list[int]:
    """Candidate indices by descending score, ties by position; identity without scores."""
    if candidate_scores is None:
        return list(range(num_candidates))
    scores = [float(s) for s in candidate_scores]
    if len(scores) != num_candidates:
        raise ValueError(f"{len(scores)} candidate scores for {num_candidates} candidates")
    if any(math.isnan(s) for s in scores):
        raise ValueError("candidate scores contain NaN; their order would be undefined")
    return sorted(range(num_candidates), key=lambda i: (-scores[i], i))
