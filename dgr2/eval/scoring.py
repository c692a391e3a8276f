"""Score a batch of model completions: strict metrics, repaired metrics, failure rates.

Why two sets of ranking metrics: the strict numbers follow the reference paper, where an
invalid output (any format error, duplicate, missing or out-of-set label) earns the
retriever's order - the model gets no credit for a broken answer but the request is not
dropped.  The repaired numbers are what serving would return after
:func:`dgr2.eval.repair.repair_ranking`; they are reported apart so repair can never
hide model failures.  Structural rates are always counted on the raw outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dgr2.eval.examples import example_candidates, example_target
from dgr2.eval.metrics import DEFAULT_KS, ranking_metrics, structural_metrics, target_rank
from dgr2.eval.parse import ParsedRanking, parse_completion
from dgr2.eval.repair import repair_ranking

Fallback = Literal["retriever", "miss"]
FALLBACKS: tuple[str, ...] = ("retriever", "miss")


@dataclass(frozen=True)
class EvalResult:
    """Everything one evaluation pass measured, ready to log or tabulate."""

    fallback: str
    metrics: dict[str, float]
    repaired_metrics: dict[str, float]
    structural: dict[str, float]
    per_example: list[dict[str, Any]] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (plain dicts, lists, numbers and strings)."""
        return {
            "fallback": self.fallback,
            "num_examples": len(self.per_example),
            "metrics": dict(self.metrics),
            "repaired_metrics": dict(self.repaired_metrics),
            "structural": dict(self.structural),
            "per_example": [dict(row) for row in self.per_example],
        }


def strict_ranking(parsed: ParsedRanking, fallback: Fallback) -> list[int]:
    """The ranking scored for an output: its own if valid, else the fallback's.

    ``"retriever"`` substitutes the identity ranking (the reference protocol);
    ``"miss"`` substitutes an empty ranking, so an invalid output scores 0 everywhere.
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"unknown fallback {fallback!r}; expected one of {FALLBACKS}")
    if parsed.valid:
        return list(parsed.ranking)
    return list(range(parsed.num_candidates)) if fallback == "retriever" else []


def score_completions(
    completions: Sequence[str],
    examples: Sequence[Mapping[str, Any]],
    fallback: Fallback = "retriever",
    candidate_scores: Sequence[Sequence[float] | None] | None = None,
    ks: Sequence[int] = DEFAULT_KS,
) -> EvalResult:
    """Parse and score one completion per example.

    ``examples[i]`` needs ``candidates`` (its length is K) and ``target_index``
    (-1 when the target is not in the list).  ``candidate_scores[i]``, when given, orders
    the candidates that repair appends (e.g. the model's per-candidate scores).
    """
    if fallback not in FALLBACKS:
        raise ValueError(f"unknown fallback {fallback!r}; expected one of {FALLBACKS}")
    if len(completions) != len(examples):
        raise ValueError(f"{len(completions)} completions for {len(examples)} examples")
    if candidate_scores is not None and len(candidate_scores) != len(examples):
        raise ValueError(f"{len(candidate_scores)} score lists for {len(examples)} examples")
    if not examples:
        raise ValueError("score_completions needs at least one example")

    parsed_all: list[ParsedRanking] = []
    strict_all: list[list[int]] = []
    repaired_all: list[list[int]] = []
    targets: list[int] = []
    rows: list[dict[str, Any]] = []
    for position, (completion, example) in enumerate(zip(completions, examples)):
        k = len(example_candidates(example, position))
        target = example_target(example, position)
        parsed = parse_completion(completion, k)
        scores = None if candidate_scores is None else candidate_scores[position]
        repair = repair_ranking(parsed, scores)
        strict = strict_ranking(parsed, fallback)
        parsed_all.append(parsed)
        strict_all.append(strict)
        repaired_all.append(repair.ranking)
        targets.append(target)
        rows.append(_row(position, target, parsed, strict, repair.ranking, repair.repaired))

    return EvalResult(
        fallback=fallback,
        metrics=ranking_metrics(strict_all, targets, ks),
        repaired_metrics=ranking_metrics(repaired_all, targets, ks),
        structural=structural_metrics(parsed_all),
        per_example=rows,
    )


def _row(
    position: int,
    target: int,
    parsed: ParsedRanking,
    strict: list[int],
    repaired: list[int],
    was_repaired: bool,
) -> dict[str, Any]:
    """One per-example record; ranks are 0-based, -1 when the target is absent."""
    strict_rank = target_rank(strict, target)
    repaired_rank = target_rank(repaired, target)
    return {
        "index": position,
        "num_candidates": parsed.num_candidates,
        "target_index": target,
        "valid": parsed.valid,
        "format_error": parsed.format_error,
        "duplicates": parsed.duplicates,
        "missing": parsed.missing,
        "out_of_set": parsed.out_of_set,
        "used_fallback": not parsed.valid,
        "repaired": was_repaired,
        "parsed_ranking": list(parsed.ranking),
        "repaired_ranking": list(repaired),
        "strict_rank": -1 if strict_rank is None else strict_rank,
        "repaired_rank": -1 if repaired_rank is None else repaired_rank,
    }
