"""Paired comparison of two rankers scored on the same requests: is a gap real at this n?

Why: issue 4's accuracy target is relative ("within 1% NDCG@10 of the best AR row"), and at the
pipeline's 300 users a split the standard error of a difference of two NDCG@10 means is about
0.01, i.e. 1.5% of the value: one table cannot tell -2% from parity.  Scoring both rankers on
the same users and taking the per-user difference removes the between-user variance (most of
it: both rankers find the same targets easy), so the standard error of the paired mean is the
honest error bar of a gap.  Validity is a proportion, with its binomial standard error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgr2.eval.metrics import ndcg_at_k
from dgr2.eval.reward import RewardConfig, reward_of_ranking
from dgr2.eval.scoring import score_completions


@dataclass(frozen=True)
class PairedDifference:
    """``mean(values) - mean(reference)`` over the same n requests, with its standard error."""

    n: int
    reference_mean: float
    mean: float
    difference: float
    standard_error: float

    @property
    def relative(self) -> float:
        """The difference as a fraction of the reference mean (NaN when that mean is 0)."""
        return self.difference / self.reference_mean if self.reference_mean else math.nan

    @property
    def z(self) -> float:
        """Difference over its standard error (0 when both are 0, inf when only the error is)."""
        if self.standard_error == 0:
            return 0.0 if self.difference == 0 else math.copysign(math.inf, self.difference)
        return self.difference / self.standard_error

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """Normal-approximation interval of the difference (95% at the default z)."""
        return self.difference - z * self.standard_error, self.difference + z * self.standard_error


def paired_difference(values: Sequence[float], reference: Sequence[float]) -> PairedDifference:
    """Mean per-request difference ``values[i] - reference[i]`` and its standard error
    (sample standard deviation of the differences over sqrt(n))."""
    n = len(values)
    if n != len(reference):
        raise ValueError(f"paired samples differ in length: {n} values against {len(reference)} reference values")
    if n < 2:
        raise ValueError(f"a paired standard error needs at least 2 requests, got {n}")
    diffs = [float(v) - float(r) for v, r in zip(values, reference)]
    mean_diff = sum(diffs) / n
    variance = sum((d - mean_diff) ** 2 for d in diffs) / (n - 1)
    return PairedDifference(
        n=n, reference_mean=sum(map(float, reference)) / n, mean=sum(map(float, values)) / n,
        difference=mean_diff, standard_error=math.sqrt(variance / n),
    )


def proportion_standard_error(successes: int, n: int) -> float:
    """Binomial standard error of a rate ``successes / n``."""
    if n <= 0:
        raise ValueError(f"a rate needs at least one trial, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in 0..{n}, got {successes}")
    p = successes / n
    return math.sqrt(p * (1 - p) / n)


def per_example_ndcg(rows: Sequence[Mapping[str, Any]], k: int = 10) -> list[float]:
    """Strict NDCG@k of each scored request (rows of :func:`dgr2.eval.scoring.score_completions`'
    ``per_example``: ``strict_rank`` is -1 when the target is absent)."""
    return [ndcg_at_k(None if int(row["strict_rank"]) < 0 else int(row["strict_rank"]), k) for row in rows]


def per_example_reward(rows: Sequence[Mapping[str, Any]], cfg: RewardConfig = RewardConfig()) -> list[float]:
    """The RL stage's reward (:mod:`dgr2.eval.reward`) of each scored request: what RL optimises,
    measured on held-out users at the evaluation's decoding rather than on training rollouts."""
    return [reward_of_ranking(bool(row["valid"]), row["parsed_ranking"], int(row["target_index"]), cfg).reward
            for row in rows]


def read_saved_completions(path: Path, examples: Sequence[Mapping[str, Any]]) -> list[str]:
    """The completions of a ``completions_<name>_<split>.jsonl`` file written by an evaluation
    (one ``{"example_id", "completion"}`` line per example), checked to be ``examples``' in order."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if [r["example_id"] for r in records] != [ex["example_id"] for ex in examples]:
        raise RuntimeError(f"{path}: completions are not in the examples' order (or not of these examples)")
    return [r["completion"] for r in records]


def score_saved_completions(path: Path, examples: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per-request scores of a saved completions file (:func:`read_saved_completions`)."""
    return score_completions(read_saved_completions(path, examples), examples).per_example


def gaps_against(
    per_model: Mapping[str, Sequence[Mapping[str, Any]]], reference: str, reward: RewardConfig = RewardConfig()
) -> dict[str, dict[str, float]]:
    """One row per model: its NDCG@10, the paired gap to ``reference`` over the same requests
    (difference, standard error, relative gap, 95% interval), its valid rate with the binomial
    standard error, and its mean RL reward (``reward``) with the paired gap and its error - RL's
    own target, so "did RL raise its reward" is answered on held-out users, not on the
    rollouts it trained on."""
    if reference not in per_model:
        raise KeyError(f"reference {reference!r} is not among the models {sorted(per_model)}")
    base = per_example_ndcg(per_model[reference])
    base_reward = per_example_reward(per_model[reference], reward)
    rows = {}
    for name, scored in per_model.items():
        gap = paired_difference(per_example_ndcg(scored), base)
        low, high = gap.interval()
        valid = sum(bool(r["valid"]) for r in scored)
        reward_gap = paired_difference(per_example_reward(scored, reward), base_reward)
        rows[name] = {
            "ndcg@10": gap.mean, "gap_vs_reference": gap.difference, "gap_se": gap.standard_error,
            "relative_gap": gap.relative, "ci95_low": low, "ci95_high": high,
            "valid_rate": valid / len(scored), "valid_se": proportion_standard_error(valid, len(scored)),
            "reward": reward_gap.mean, "reward_gap": reward_gap.difference, "reward_gap_se": reward_gap.standard_error,
        }
    return rows
