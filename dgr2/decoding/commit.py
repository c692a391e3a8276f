"""The per-step commit rule of block-diffusion decoding, shared by every decoder variant.

Paper rule: at each step commit every masked position whose confidence (max softmax
probability) is at least ``threshold``, and at least the single most confident one.  We add
one floor so a block always finishes within its step budget: with ``r`` masked positions and
``s`` steps left, at least ``ceil(r / s)`` are committed (the most confident ones).  With
``threshold = 1.0`` and ``steps = block size`` this is one token per step; a lower threshold
commits more in parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum

import torch


def commit_step(
    logits: torch.Tensor,
    masked: torch.Tensor,
    threshold: float,
    steps_left: int,
    mask_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(commit, tokens, logprobs)`` for a ``(rows, L, vocab)`` step: which masked slots to
    fill, with what, and each proposed token's log-probability under the sampling distribution.

    ``temperature = 0`` is greedy (the argmax; its log-prob is under the untempered softmax);
    ``temperature > 0`` samples every slot from ``softmax(logits / T)`` and uses the sampled
    token's probability as its confidence (RL and OPD rollouts need diverse trajectories).
    The ``[MASK]`` id itself is never a candidate, so no output can contain it.
    """
    if steps_left < 1:
        raise ValueError(f"steps_left must be >= 1, got {steps_left}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    logits = logits.float().clone()
    logits[..., mask_id] = float("-inf")
    if temperature > 0:
        logp = (logits / temperature).log_softmax(-1)
        flat = logp.exp().reshape(-1, logp.shape[-1])
        tokens = torch.multinomial(flat, 1, generator=generator).reshape(logp.shape[:-1])
        token_logp = logp.gather(-1, tokens[..., None]).squeeze(-1)
    else:
        logp = logits.log_softmax(-1)
        token_logp, tokens = logp.max(-1)
    confidence = token_logp.exp().masked_fill(~masked, float("-inf"))
    remaining = masked.sum(-1, keepdim=True)
    floor = torch.where(remaining > 0, (remaining + steps_left - 1) // steps_left, remaining)
    order = torch.sort(confidence, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    commit = masked & ((confidence >= threshold) | (rank < floor))
    return commit, tokens, token_logp


class BlockState(Enum):
    OPEN = "open"  # masked slots remain before any stop
    COMPLETE = "complete"  # every slot committed, no stop token
    STOPPED = "stopped"  # a stop token is committed and every slot before it too


def block_state(tokens: Sequence[int], masked: Sequence[bool], stops: frozenset[int]) -> BlockState:
    """Read one row's block left to right: a committed stop with a committed prefix ends the
    sequence early (whatever follows it would be discarded anyway)."""
    for token, is_masked in zip(tokens, masked):
        if is_masked:
            return BlockState.OPEN
        if token in stops:
            return BlockState.STOPPED
    return BlockState.COMPLETE
