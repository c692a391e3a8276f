"""Which completion tokens are masked in a training example: ratio schedules and block sampling.

Every completion block is noised independently.  A uniform draw ``u ~ U(0, 1)`` is mapped by
the schedule to a mask ratio ``t`` in ``[eps, 1]``:

* ``uniform``: ``t = eps + (1 - eps) u`` - the ratio itself is uniform.  This is what the
  masked-diffusion literature calls the *linear* noise schedule (keep-probability ``1 - t``).
* ``linear``: the density of ``t`` rises linearly (``p(t) ~ t``, ``t = eps + (1 - eps) sqrt(u)``)
  - more heavily masked blocks, like the first denoising steps of a fully masked block.
* ``cosine``: MaskGIT's ``t = eps + (1 - eps) cos(pi/2 u)`` - mass concentrates near ``t = 1``
  even more strongly, with a thin tail of lightly masked blocks.

Then exactly ``k = clamp(round(t n), 1, n)`` of the block's ``n`` supervised tokens are masked,
chosen uniformly.  Why an exact count instead of independent coin flips: small blocks would
often get zero masked tokens (a wasted block) and the realised ratio ``k / n`` is known
exactly, which is the ratio the ``1/t`` loss weight uses (for a fixed ``k`` the masked set
is a uniform ``k``-subset, so ``n/k * sum(masked CE)`` is an unbiased estimate of the sum
over all tokens of the any-order model's CE - the masked-diffusion ELBO term).

Suffix blocks (``suffix_prob``): with that probability a block masks its *last* ``k``
supervised tokens instead of a uniform ``k``-subset.  Why: a left-to-right decoder
(:mod:`dgr2.decoding.commit`) only ever visits states where a block's committed tokens are a
prefix, and a uniform ``k``-subset is almost never such a state (1 in ``C(32, k)``), so the
model would be trained nearly only on contexts it never decodes from.  Suffix blocks are not
part of the any-order ELBO; they are extra supervision on the decoder's own states (the
``1/t`` weight still uses the realised ratio ``k / n``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

MaskSchedule = Literal["uniform", "linear", "cosine"]
SCHEDULES: tuple[str, ...] = ("uniform", "linear", "cosine")


def mask_ratio(u: torch.Tensor, schedule: MaskSchedule, eps: float) -> torch.Tensor:
    """Map uniform draws in [0, 1] to mask ratios in [eps, 1] (see module docstring)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown mask schedule {schedule!r}; choose one of {SCHEDULES}")
    if not 0.0 < eps < 1.0:
        raise ValueError(f"mask eps must be in (0, 1), got {eps}")
    if schedule == "uniform":
        shaped = u
    elif schedule == "linear":
        shaped = u.sqrt()
    else:
        shaped = torch.cos(0.5 * math.pi * u)
    return eps + (1.0 - eps) * shaped


def sample_block_masks(
    supervised: torch.Tensor,
    block_size: int,
    schedule: MaskSchedule,
    eps: float,
    generator: torch.Generator | None = None,
    suffix_prob: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose masked completion tokens block by block (suffix blocks with ``suffix_prob``).

    ``supervised`` is a ``(batch, length)`` bool tensor of completion tokens that carry loss;
    only they can be masked.  Returns ``(masked, ratio)``: the bool mask and, per token, the
    realised ratio ``k / n`` of its block (1.0 where the block has no supervised token).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if not 0.0 <= suffix_prob <= 1.0:
        raise ValueError(f"suffix_prob must be in [0, 1], got {suffix_prob}")
    batch, length = supervised.shape
    n_blocks = -(-length // block_size)
    padded = torch.zeros((batch, n_blocks * block_size), dtype=torch.bool, device=supervised.device)
    padded[:, :length] = supervised
    blocks = padded.view(batch, n_blocks, block_size)
    n = blocks.sum(-1)  # (batch, n_blocks)
    u = torch.rand((batch, n_blocks), generator=generator, device="cpu").to(supervised.device)
    k = torch.round(mask_ratio(u, schedule, eps) * n).long().clamp(min=1)
    k = torch.minimum(k, n)
    scores = torch.rand(blocks.shape, generator=generator, device="cpu").to(supervised.device)
    if suffix_prob > 0:
        suffix = torch.rand((batch, n_blocks), generator=generator, device="cpu").to(supervised.device) < suffix_prob
        last_first = torch.arange(block_size, 0, -1, device=supervised.device, dtype=scores.dtype) / (block_size + 1)
        scores = torch.where(suffix[..., None], last_first.expand_as(scores), scores)
    scores = scores.masked_fill(~blocks, float("inf"))  # unsupervised slots sort last
    rank = scores.argsort(-1).argsort(-1)
    masked = (rank < k[..., None]) & blocks
    ratio = torch.where(n > 0, k.float() / n.clamp(min=1).float(), torch.ones_like(n, dtype=torch.float))
    ratio = ratio[..., None].expand(-1, -1, block_size)
    return masked.reshape(batch, -1)[:, :length], ratio.reshape(batch, -1)[:, :length]
