"""Per-token divergences between a student and a teacher next-token distribution (OPD).

Why three: on-policy distillation papers differ on the direction.  Reverse KL
``KL(student || teacher)`` is mode seeking (the student commits to the teacher's best token,
which is what a confidence-threshold decoder rewards), forward KL ``KL(teacher || student)`` is
mass covering (the Diffusion-GR2 paper's choice), and the generalised JSD interpolates
(``beta`` = weight of the teacher in the mixture; 0.5 is symmetric JSD).

All take ``(tokens, vocab)`` logits and return the per-token divergence in nats (>= 0, exactly 0
when the distributions are equal).  ``teacher_top_k`` keeps the teacher's k most likely tokens
and spreads the remaining mass uniformly over the rest of the vocabulary, so a top-k teacher
(cheaper to ship from a big model) is still a proper distribution on the full support.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Divergence = Literal["reverse_kl", "forward_kl", "jsd"]


def teacher_log_probs(teacher_logits: torch.Tensor, top_k: int | None = None) -> torch.Tensor:
    """Teacher log-probabilities, optionally truncated to its top-k (see module docstring)."""
    logp = teacher_logits.float().log_softmax(-1)
    vocab = logp.shape[-1]
    if top_k is None or top_k >= vocab:
        return logp
    top, index = logp.topk(top_k, dim=-1)
    kept = top.exp().sum(-1, keepdim=True).clamp(max=1.0)
    rest = ((1.0 - kept).clamp(min=1e-12) / (vocab - top_k)).log()
    return rest.expand_as(logp).clone().scatter_(-1, index, top)


def token_divergence(
    student_logits: torch.Tensor,
    teacher_logp: torch.Tensor,
    kind: Divergence = "reverse_kl",
    beta: float = 0.5,
) -> torch.Tensor:
    """``(tokens,)`` divergence of each student distribution from the teacher's."""
    s = student_logits.float().log_softmax(-1)
    t = teacher_logp.float()
    if kind == "reverse_kl":
        return (s.exp() * (s - t)).sum(-1)
    if kind == "forward_kl":
        return (t.exp() * (t - s)).sum(-1)
    if kind == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
        mix = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), dim=0)
        return beta * (t.exp() * (t - mix)).sum(-1) + (1 - beta) * (s.exp() * (s - mix)).sum(-1)
    raise ValueError(f"unknown divergence {kind!r}; choose reverse_kl, forward_kl or jsd")
