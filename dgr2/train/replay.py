"""Rebuild the states a block-diffusion decoder went through, from a recorded trajectory.

Why: OPD scores the student on the partially masked blocks it actually saw while decoding, and
RL needs the policy's log-probability of its own trajectory.  A block-diffusion decode of a
block is a sequence of steps; at step ``k`` every slot committed at a step ``>= k`` (or never
committed) is still ``[MASK]``, and the slots committed at step ``k`` are sampled from the
model's predictions in that state.  The decoder records each token's step
(``DecodeOutput.unmask_steps``), so the state before any step is a pure function of the
trajectory, and one forward pass of :meth:`BlockDiffusionLM.shifted_logits` on it reproduces
the decoder's logits exactly (same attention rule, same positions, same prediction shift) -
provided the discarded tail of the last block (slots after the stop token) is included, which
is why trajectories keep it.

Log-probability estimator (RL): ``log pi(y) = sum_k sum_{j committed at k} log p_k(y_j)`` where
``p_k`` is the model's (temperature-scaled) distribution in the state before step ``k``.  It is
the exact log-probability of the tokens *given* the recorded unmasking order; the probability of
the order itself (which positions passed the confidence threshold) is not differentiable and is
left out, as in the Diffusion-GR2 paper's replay estimator.  Passing ``replay_steps`` samples a
subset of the steps per update (an unbiased estimate of the per-token objective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dgr2.models.block_diffusion import DiffusionBatch

NEVER = 1 << 20  # step of a slot that was still masked when its row stopped


@dataclass(frozen=True)
class ReplayBatch:
    """Trajectories as tensors: the diffusion batch plus each completion slot's recorded step.

    ``loss_mask`` (inside ``batch``) marks the kept tokens (up to and including the stop); the
    tail after the stop is context only.  ``steps`` is ``(batch, Lc)`` with ``NEVER`` for slots
    never committed and for padding.
    """

    batch: DiffusionBatch
    steps: torch.Tensor
    old_logprobs: torch.Tensor  # (batch, Lc) sampling log-prob of each kept token (0 elsewhere)

    @classmethod
    def collate(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        unmask_steps: Sequence[Sequence[int]],
        tails: Sequence[Sequence[int]],
        tail_steps: Sequence[Sequence[int]],
        token_logprobs: Sequence[Sequence[float]],
        pad_id: int,
        device: torch.device | str = "cpu",
    ) -> "ReplayBatch":
        full = [list(c) + list(t) for c, t in zip(completions, tails)]
        loss_masks = [[True] * len(c) + [False] * len(t) for c, t in zip(completions, tails)]
        batch = DiffusionBatch.collate(prompts, full, pad_id, loss_masks=loss_masks, device=device)
        lc = batch.completion_ids.shape[1]
        steps = torch.full((len(full), lc), NEVER, dtype=torch.long)
        old = torch.zeros((len(full), lc), dtype=torch.float32)
        for i, (s, ts, lp) in enumerate(zip(unmask_steps, tail_steps, token_logprobs)):
            row = [NEVER if v < 0 else int(v) for v in list(s) + list(ts)]
            if len(row) != len(full[i]) or len(lp) != len(completions[i]):
                raise ValueError(f"trajectory {i}: steps/logprobs do not match its tokens")
            steps[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            old[i, : len(lp)] = torch.tensor(list(lp), dtype=torch.float32)
        return cls(batch, steps.to(device), old.to(device))

    def state_before(self, step_per_slot: torch.Tensor, mask_id: int) -> torch.Tensor:
        """Completion ids with every slot whose recorded step is ``>= step_per_slot`` masked."""
        masked = self.steps >= step_per_slot
        return torch.where(masked, torch.full_like(self.batch.completion_ids, mask_id), self.batch.completion_ids)

    def block_max_step(self, block_size: int) -> torch.Tensor:
        """``(batch, Lc)``: the last recorded step of each slot's block (-1 for an empty block)."""
        n, lc = self.steps.shape
        n_blocks = -(-lc // block_size)
        padded = torch.full((n, n_blocks * block_size), -1, dtype=torch.long, device=self.steps.device)
        committed = torch.where(self.steps >= NEVER, torch.full_like(self.steps, -1), self.steps)
        supervised = self.batch.loss_mask.bool()
        padded[:, :lc] = torch.where(supervised, committed, torch.full_like(committed, -1))
        top = padded.view(n, n_blocks, block_size).max(-1).values
        return top.repeat_interleave(block_size, dim=1)[:, :lc]

    def sample_step_per_block(self, block_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """One recorded step per block, uniformly among the steps that block took."""
        top = self.block_max_step(block_size)
        n, lc = top.shape
        n_blocks = -(-lc // block_size)
        u = torch.rand((n, n_blocks), generator=generator).to(top.device)
        per_block = top[:, ::block_size]
        k = torch.floor(u * (per_block + 1).clamp(min=1)).long()
        return k.repeat_interleave(block_size, dim=1)[:, :lc]
