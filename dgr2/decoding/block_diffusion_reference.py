"""Reference block-diffusion decoder: no KV cache, the whole sequence recomputed every step.

It exists to check :mod:`dgr2.decoding.block_diffusion`: both share the decoding loop (commit
and stop rules) and differ only in how a step's logits are computed.  Here each step feeds
``[prompt | clean completed blocks | current block]`` in full, with the training attention
rule, and reads slot ``i`` at column ``i - 1`` (slot 0 at the last clean token).  Slow by
design (quadratic in the output length); not for evaluation runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import PreTrainedModel

from dgr2.decoding.batching import left_pad, positions_from_mask
from dgr2.decoding.block_layout import block_layout, prompt_layout
from dgr2.decoding.block_loop import BlockDecodeSettings, SlotLogits, decode_blocks
from dgr2.decoding.commit import CommitOrder
from dgr2.decoding.output import DecodeOutput
from dgr2.decoding.runtime import model_device
from dgr2.models.block_diffusion import BlockDiffusionLM
from dgr2.models.block_mask import TokenKind, TokenLayout, additive_mask, allowed_attention


class UncachedBlockPredictor:
    def __init__(self, model: PreTrainedModel, prompts: list[Sequence[int]], settings: BlockDecodeSettings):
        self.model = model
        self.settings = settings
        self.device = model_device(model)
        self.prompt_ids, self.prompt_mask = left_pad(prompts, settings.pad_id, self.device)
        self.completed = torch.zeros((len(prompts), 0), dtype=torch.long, device=self.device)
        self.block_index = 0
        self.length = 0

    def begin_block(self, block_index: int, length: int) -> None:
        self.block_index, self.length = block_index, length

    def block_logits(self, block: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None = None) -> SlotLogits:
        # every row is recomputed whatever ``rows`` says: the reference trades speed for simplicity
        rows, length = block.shape
        lp, done = self.prompt_ids.shape[1], self.completed.shape[1]
        prompt_len = self.prompt_mask.sum(1, keepdim=True)
        j = torch.arange(done + length, device=self.device)
        ids = torch.cat([self.prompt_ids, self.completed, block], 1)
        pos = torch.cat([positions_from_mask(self.prompt_mask), prompt_len + j], 1)
        clean = TokenLayout(
            torch.full((rows, done), int(TokenKind.CLEAN), dtype=torch.long, device=self.device),
            (j[:done] // self.settings.block_size).expand(rows, -1).contiguous(),
            (lp + j[:done]).expand(rows, -1).contiguous(),
        )
        noisy = block_layout(rows, length, TokenKind.NOISY, self.block_index, lp + done, self.device)
        tokens = prompt_layout(self.prompt_mask).cat(clean).cat(noisy)
        mask = additive_mask(allowed_attention(tokens, tokens), self.model.dtype)
        keep = lp + done - 1 + slots  # slot i is read at the column before it
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=keep).logits
        return SlotLogits(logits=logits)  # the model's own head on every slot: what the cached decoder must match

    def end_block(self, block: torch.Tensor, keep: torch.Tensor) -> None:
        self.prompt_ids, self.prompt_mask = self.prompt_ids[keep], self.prompt_mask[keep]
        self.completed = torch.cat([self.completed[keep], block], 1)


def diffusion_generate_uncached(
    model: PreTrainedModel | BlockDiffusionLM,
    prompt_ids: Sequence[Sequence[int]],
    *,
    block_size: int,
    max_steps_per_block: int,
    threshold: float,
    max_new_tokens: int,
    mask_id: int,
    eos_id: int | None,
    pad_id: int,
    stop_ids: Iterable[int] = (),
    batch_size: int = 32,
    temperature: float = 0.0,
    seed: int | None = None,
    commit_order: CommitOrder = "confidence",
    defer_repeats: bool = False,
    strict_threshold: float | None = None,
    strict_after: Iterable[int] = (),
) -> DecodeOutput:
    """Same contract and decisions as ``diffusion_generate``, computed without a cache."""
    return decode_blocks(
        model, prompt_ids, UncachedBlockPredictor, block_size=block_size, max_steps_per_block=max_steps_per_block,
        threshold=threshold, max_new_tokens=max_new_tokens, mask_id=mask_id, eos_id=eos_id, pad_id=pad_id,
        stop_ids=stop_ids, batch_size=batch_size,
        temperature=temperature, seed=seed, commit_order=commit_order, defer_repeats=defer_repeats,
        strict_threshold=strict_threshold, strict_after=strict_after,
    )
