"""Listwise (softmax) logistic regression: weights that make the target likely among candidates.

Why this model: a re-ranking example has exactly one relevant candidate, so the natural
likelihood is the softmax probability of the target over its own candidate list.  That loss
is convex in the weights, small (a few dozen features) and Newton's method solves it to
machine precision in a handful of deterministic steps, with no learning rate to tune.

Features are standardised with train statistics first, so an L2 penalty (and the trace
teacher's Gaussian weight noise) treats every feature on the same scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ListwiseModel:
    """score(x) = weights . (x - mean) / scale."""

    weights: np.ndarray
    mean: np.ndarray
    scale: np.ndarray

    def scores(self, features: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        """Scores of a (num_candidates, dim) matrix, optionally with other (e.g. noisy) weights."""
        w = self.weights if weights is None else weights
        return ((features - self.mean) / self.scale) @ w


def fit_listwise(
    features: Sequence[np.ndarray],
    targets: Sequence[int],
    l2: float = 1e-3,
    max_iter: int = 50,
    tol: float = 1e-8,
) -> tuple[ListwiseModel, dict[str, float]]:
    """Maximise mean log softmax(target) - l2/2 |w|^2 over examples with Newton steps.

    ``features[i]`` is a (K_i, dim) matrix (K may vary per example); ``targets[i]`` indexes
    its target row.  Returns the model and a small report (iterations, final loss).
    """
    if len(features) != len(targets):
        raise ValueError(f"{len(features)} feature matrices but {len(targets)} targets")
    if not features:
        raise ValueError("no training examples to fit the teacher on")
    dims = {f.shape[1] for f in features}
    if len(dims) != 1:
        raise ValueError(f"feature dimensions differ across examples: {sorted(dims)}")
    for i, (f, t) in enumerate(zip(features, targets)):
        if not 0 <= t < f.shape[0]:
            raise ValueError(f"example {i}: target {t} outside 0..{f.shape[0] - 1}")
    stacked = np.concatenate(features)
    mean = stacked.mean(axis=0)
    scale = stacked.std(axis=0)
    scale[scale < 1e-9] = 1.0  # constant features: keep them at 0 instead of dividing by 0
    groups = _group_by_length(features, targets, mean, scale)
    dim = stacked.shape[1]
    n = len(features)
    weights = np.zeros(dim)

    def objective(w: np.ndarray) -> float:
        total = sum(_batched_log_softmax(z @ w)[np.arange(len(t)), t].sum() for z, t in groups)
        return -float(total) / n + 0.5 * l2 * float(w @ w)

    loss = objective(weights)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        grad = l2 * weights
        hess = l2 * np.eye(dim)
        for z, t in groups:
            p = np.exp(_batched_log_softmax(z @ weights))  # (n_g, K)
            expected = np.einsum("nk,nkd->nd", p, z)
            grad = grad - (z[np.arange(len(t)), t] - expected).sum(axis=0) / n
            hess = hess + (np.einsum("nk,nki,nkj->ij", p, z, z) - expected.T @ expected) / n
        step = np.linalg.solve(hess, grad)
        # Backtracking keeps Newton monotone even far from the optimum.
        size = 1.0
        while size > 1e-4:
            candidate = weights - size * step
            new_loss = objective(candidate)
            if new_loss <= loss:
                break
            size *= 0.5
        else:
            break
        weights, improvement, loss = candidate, loss - new_loss, new_loss
        if improvement < tol:
            break
    report = {"iterations": float(iterations), "train_nll": float(loss), "examples": float(n)}
    return ListwiseModel(weights=weights, mean=mean, scale=scale), report


def _batched_log_softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _group_by_length(
    features: Sequence[np.ndarray], targets: Sequence[int], mean: np.ndarray, scale: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Stack standardised examples with equal candidate counts into (n, K, dim) blocks."""
    by_length: dict[int, list[int]] = {}
    for i, f in enumerate(features):
        by_length.setdefault(f.shape[0], []).append(i)
    return [
        (
            (np.stack([features[i] for i in idx]) - mean) / scale,
            np.array([targets[i] for i in idx], dtype=np.int64),
        )
        for idx in by_length.values()
    ]
