"""A rule teacher fitted on the train split: readable evidence, a linear score, a ranking.

Why this shape: the AR re-ranker is trained to imitate this teacher, so every step of its
trace must be learnable from the prompt.  The trace states what the history shows, then
for each candidate the evidence the score uses and a 0-19 score level; the answer is exactly
the candidates sorted by that level (descending, ties by retriever position).  So the last
step (trace -> answer) is a deterministic sort the model can learn exactly.

Trace grammar (one line per candidate, ``;``-separated)::

    recent <a_3> ;
    c1 <a_3> a 1 r 1 crowd 1 pop 13 score 17 ; c2 <a_9> a 0 r 0 crowd 0 pop 18 score 4 ; ... ;
    scores c1 17 c2 4 ... ; order 19 18 c3 17 c1 c5 16 ... 0

Each candidate line restates the candidate's level-a code before the counts that depend on
it.  Why: without it, writing ``a`` needs two hops (label -> the candidate's code in the
prompt -> matches in the history), and a 4-layer student wrote a wrong ``a`` for 82% and a
wrong ``crowd`` for 89% of candidates whose true count was >= 1 (it just wrote 0, scoring
like popularity).  With the code copied into the line (one hop, like the ``recent`` line,
copied right 99.97% of the time), each count is one lookup from a token in context.

The sort is written out as two lookups a small transformer learns reliably (measured: with
the candidate lines alone, a 4-layer model learned the evidence but copied the input order
into the answer).  ``scores`` restates every ``label digit`` pair side by side; ``order``
walks the levels 19..0 and after each level lists, in position order, the labels whose score
is that digit (an induction-style lookup over the adjacent pairs).  The answer is then a
copy of the labels of ``order`` in sequence.

``recent``: the last history item's level-a code; ``a``: history items sharing the
candidate's level-a code; ``r``: whether that is the recent code; ``crowd``: other candidates
sharing its level-a code; ``pop``: popularity bucket (see :mod:`dgr2.traces.evidence`; counts
are capped at the teacher's ``max_count``).  The score level is the 20-quantile of the
candidate's linear score among all train candidates: a fixed, per-candidate scale, so a
candidate's level does not depend on which other candidates happen to be in the list.  20
levels, not 10: the noise-free teacher's test NDCG@10 is 0.667 with deciles and 0.676 with
20 levels (Amazon Beauty, n=3000), because fewer candidates tie.

Weights come from listwise logistic regression on train examples (the target's softmax
probability among its candidates).  ``propose`` adds Gaussian noise to the (standardised)
weights, giving diverse but self-consistent traces for rejection sampling.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dgr2.eval.examples import example_target
from dgr2.tokenizer.catalog import ItemCatalog
from dgr2.traces import format as fmt
from dgr2.traces.evidence import FEATURE_NAMES, MAX_COUNT, RequestEvidence, feature_matrix, gather_evidence
from dgr2.traces.listwise import ListwiseModel, fit_listwise
from dgr2.traces.teacher import RerankRequest, Trace

NUM_SCORE_BUCKETS = 20
if NUM_SCORE_BUCKETS > len(fmt.NUMBERS):
    raise ImportError("score levels must be number words of the grammar")


def render_trace(evidence: RequestEvidence, score_buckets: np.ndarray) -> list[str]:
    """The trace words for this evidence and these per-candidate score digits."""
    words: list[str] = ["recent", evidence.recent if evidence.recent is not None else "none"]
    for ev, bucket in zip(evidence.candidates, score_buckets):
        words += [";", fmt.candidate_label(ev.position), ev.code_a, "a", str(ev.hist_a), "r", str(int(ev.recent_a))]
        words += ["crowd", str(ev.crowd), fmt.POP, str(ev.pop), "score", str(int(bucket))]
    words += [";", "scores"]
    for ev, bucket in zip(evidence.candidates, score_buckets):
        words += [fmt.candidate_label(ev.position), str(int(bucket))]
    words += [";", "order"]
    return words + render_order([(fmt.candidate_label(ev.position), int(b))
                                 for ev, b in zip(evidence.candidates, score_buckets)])


def render_order(labelled_scores: Sequence[tuple[str, int]]) -> list[str]:
    """The ``order`` section's words for ``(label, score digit)`` pairs in position order: each
    level from the highest down, followed by the labels at that level (a bucket sort written out)."""
    words: list[str] = []
    for digit in range(NUM_SCORE_BUCKETS - 1, -1, -1):
        words.append(str(digit))
        words += [label for label, b in labelled_scores if b == digit]
    return words


def ranking_from_buckets(score_buckets: np.ndarray) -> list[int]:
    """Candidates by displayed score level, descending; equal levels keep retriever order."""
    return sorted(range(len(score_buckets)), key=lambda i: (-int(score_buckets[i]), i))


class RuleTeacher:
    """Listwise-fitted linear teacher over prompt-only evidence."""

    name = "rule"

    def __init__(
        self,
        catalog: ItemCatalog,
        model: ListwiseModel,
        score_edges: np.ndarray,
        weight_noise: float = 0.5,
        fit_report: dict[str, Any] | None = None,
        max_count: int = MAX_COUNT,
    ):
        edges = np.asarray(score_edges, dtype=np.float64)
        if edges.shape != (NUM_SCORE_BUCKETS - 1,) or np.any(np.diff(edges) < 0):
            raise ValueError(f"score_edges must be {NUM_SCORE_BUCKETS - 1} non-decreasing values, got {edges}")
        if model.weights.shape != (len(FEATURE_NAMES),):
            raise ValueError(f"model has {model.weights.shape} weights, features are {len(FEATURE_NAMES)}")
        if weight_noise < 0:
            raise ValueError(f"weight_noise must be >= 0, got {weight_noise}")
        self.catalog = catalog
        self.model = model
        self.score_edges = edges
        if not 1 <= max_count <= MAX_COUNT:
            raise ValueError(f"max_count must be in 1..{MAX_COUNT}, got {max_count}")
        self.weight_noise = float(weight_noise)
        self.max_count = int(max_count)
        self.fit_report = dict(fit_report or {})

    # ------------------------------------------------------------------ fitting
    @classmethod
    def fit(
        cls,
        catalog: ItemCatalog,
        train_examples: Iterable[Mapping[str, Any]],
        weight_noise: float = 0.5,
        l2: float = 1e-3,
        max_count: int = MAX_COUNT,
    ) -> "RuleTeacher":
        """Fit weights on train examples (``history``, ``candidates``, ``target_index``).

        Examples whose target is not among the candidates (``target_index == -1``) carry no
        listwise signal and are skipped (counted in ``fit_report``).
        """
        matrices: list[np.ndarray] = []
        targets: list[int] = []
        skipped = 0
        for position, example in enumerate(train_examples):
            target = example_target(example, position)
            if target < 0:
                skipped += 1
                continue
            request = RerankRequest.from_example(example)
            matrices.append(feature_matrix(gather_evidence(catalog, request.history, request.candidates, max_count)))
            targets.append(target)
        if not matrices:
            raise ValueError("no train example has its target among the candidates: nothing to fit")
        model, report = fit_listwise(matrices, targets, l2=l2)
        train_scores = np.concatenate([model.scores(m) for m in matrices])
        edges = np.quantile(train_scores, np.arange(1, NUM_SCORE_BUCKETS) / NUM_SCORE_BUCKETS)
        report.update(
            skipped_no_target=float(skipped),
            weights={name: round(float(w), 4) for name, w in zip(FEATURE_NAMES, model.weights)},
        )
        return cls(catalog, model, edges, weight_noise=weight_noise, fit_report=report, max_count=max_count)

    # ------------------------------------------------------------------ ranking
    def evidence(self, request: RerankRequest) -> RequestEvidence:
        return gather_evidence(self.catalog, request.history, request.candidates, self.max_count)

    def score_buckets(self, evidence: RequestEvidence, weights: np.ndarray | None = None) -> np.ndarray:
        """Score level 0-19 per candidate: which train-score 20-quantile its linear score falls in."""
        scores = self.model.scores(feature_matrix(evidence), weights)
        return np.searchsorted(self.score_edges, scores, side="right")

    def _trace(self, evidence: RequestEvidence, weights: np.ndarray | None) -> Trace:
        buckets = self.score_buckets(evidence, weights)
        return Trace(think_tokens=render_trace(evidence, buckets), ranking=ranking_from_buckets(buckets))

    def rank(self, request: RerankRequest) -> Trace:
        """The noise-free trace and ranking."""
        return self._trace(self.evidence(request), None)

    def propose(self, request: RerankRequest, num_samples: int, rng: np.random.Generator) -> list[Trace]:
        """``num_samples`` traces, each scored with its own noisy copy of the weights."""
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        evidence = self.evidence(request)
        dim = self.model.weights.shape[0]
        return [
            self._trace(evidence, self.model.weights + self.weight_noise * rng.standard_normal(dim))
            for _ in range(num_samples)
        ]

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "features": list(FEATURE_NAMES),
            "weights": self.model.weights.tolist(),
            "mean": self.model.mean.tolist(),
            "scale": self.model.scale.tolist(),
            "score_edges": self.score_edges.tolist(),
            "weight_noise": self.weight_noise,
            "max_count": self.max_count,
            "fit_report": self.fit_report,
        }

    def save(self, path: str | Path) -> Path:
        """Weights as JSON (the catalog is saved separately with ``ItemCatalog.save``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: str | Path, catalog: ItemCatalog) -> "RuleTeacher":
        payload = json.loads(Path(path).read_text())
        if payload.get("features") != list(FEATURE_NAMES):
            raise ValueError(f"{path}: saved features {payload.get('features')} differ from {list(FEATURE_NAMES)}")
        model = ListwiseModel(
            weights=np.array(payload["weights"]), mean=np.array(payload["mean"]), scale=np.array(payload["scale"])
        )
        return cls(
            catalog, model, np.array(payload["score_edges"]), payload["weight_noise"], payload.get("fit_report"),
            max_count=payload.get("max_count", MAX_COUNT),
        )
