"""Block-diffusion decoding with a KV cache of the prefix (prompt + completed blocks).

Each step is one forward pass over the current block only, against the cached prefix; the
block's own keys/values are cropped off the cache after the step, so masked tokens never
stay in it.  A completed block becomes cache exactly once, and without an extra pass: the
first step of block ``b`` feeds ``[clean block b-1 | masked block b]`` together (for block 0,
``[prompt | masked block 0]``, which doubles as the prefill), the clean half is kept in the
cache and the noisy half cropped.  Attention follows the training rule of
:mod:`dgr2.models.block_mask` (the cache's metadata is passed as extra keys), positions are
the clean positions, and the prediction for block slot ``i`` is read at slot ``i - 1`` - for
slot 0 at the last clean token before the block, whose logits are kept from the first step
(that token never sees the block, so its logits cannot change within the block).

A pass therefore costs ``block`` query tokens (plus ``block`` more on the first step), and
AR decoding is the ``block_size = 1`` case: one pass per token, same logits.  The LM head
runs only at the slots the loop asks for (those still masked in some row): on CPU it is
about 40% of a pass at a 9k vocabulary, and a block is on average half committed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from dgr2.decoding.batching import left_pad, positions_from_mask
from dgr2.decoding.block_layout import block_layout, empty_layout, prompt_layout
from dgr2.decoding.block_loop import BlockDecodeSettings, decode_blocks
from dgr2.decoding.commit import CommitOrder
from dgr2.decoding.output import DecodeOutput
from dgr2.decoding.runtime import model_device
from dgr2.models.block_diffusion import BlockDiffusionLM
from dgr2.models.block_mask import TokenKind, TokenLayout, additive_mask, allowed_attention


class CachedBlockPredictor:
    """Step logits from one forward over the current block against a KV cache of the prefix."""

    def __init__(self, model: PreTrainedModel, prompts: list[Sequence[int]], settings: BlockDecodeSettings):
        self.model = model
        self.settings = settings
        self.device = model_device(model)
        ids, mask = left_pad(prompts, settings.pad_id, self.device)
        self.prompt_len = mask.sum(1)
        self.cache = DynamicCache(config=model.config)
        self.cached = empty_layout(len(prompts), self.device)
        # tokens to write into the cache with the next step (the prompt, then each finished block)
        self.pending: tuple[torch.Tensor, torch.Tensor, TokenLayout] | None = (
            ids, positions_from_mask(mask), prompt_layout(mask)
        )
        self.first_logits: torch.Tensor | None = None
        self.block_index = 0
        self.length = 0
        self.block_pos = torch.empty(0)

    def begin_block(self, block_index: int, length: int) -> None:
        self.block_index, self.length = block_index, length
        offsets = block_index * self.settings.block_size + torch.arange(length, device=self.device)
        self.block_pos = self.prompt_len[:, None] + offsets

    def block_logits(self, block: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows, length = block.shape
        if self.pending is not None:
            ids, pos, layout = self.pending
            noisy = block_layout(rows, length, TokenKind.NOISY, self.block_index, self.cached.length + layout.length, self.device)
            queries = layout.cat(noisy)
            keep = layout.length - 1 + slots  # slot i is read at the query before it (slot 0: last clean token)
            logits = self._forward(torch.cat([ids, block], 1), torch.cat([pos, self.block_pos], 1), queries, keep)
            self.cached = self.cached.cat(layout)
            self.pending = None
            if int(slots[0]) != 0:
                raise RuntimeError("the first step of a block must predict slot 0")
            self.first_logits = logits[:, :1]
            return logits
        noisy = block_layout(rows, length, TokenKind.NOISY, self.block_index, self.cached.length, self.device)
        later = slots[slots > 0]
        logits = self._forward(block, self.block_pos, noisy, later - 1)
        return torch.cat([self.first_logits, logits], 1) if int(slots[0]) == 0 else logits

    def end_block(self, block: torch.Tensor, keep: torch.Tensor) -> None:
        if len(keep) < self.prompt_len.shape[0]:
            self.cache.batch_select_indices(keep)
            self.cached = self.cached.rows(keep)
            self.prompt_len, self.block_pos = self.prompt_len[keep], self.block_pos[keep]
        layout = block_layout(len(keep), self.length, TokenKind.CLEAN, self.block_index, self.cached.length, self.device)
        self.pending = (block, self.block_pos, layout)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, queries: TokenLayout, keep: torch.Tensor) -> torch.Tensor:
        """Run ``ids`` against the cache, keep their clean part, drop the noisy block."""
        keys = self.cached.cat(queries)
        mask = additive_mask(allowed_attention(queries, keys), self.model.dtype)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, cache=self.cache, use_cache=True, logits_to_keep=keep
        )
        self.cache.crop(-self.length)
        return out.logits


def diffusion_generate(
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
) -> DecodeOutput:
    """Block-diffusion continuations (new tokens only, cut after the first stop, inclusive).

    ``eos_id=None`` with no ``stop_ids`` produces exactly ``max_new_tokens`` per prompt.
    """
    return decode_blocks(
        model, prompt_ids, CachedBlockPredictor, block_size=block_size, max_steps_per_block=max_steps_per_block,
        threshold=threshold, max_new_tokens=max_new_tokens, mask_id=mask_id, eos_id=eos_id, pad_id=pad_id,
        stop_ids=stop_ids, batch_size=batch_size,
        temperature=temperature, seed=seed, commit_order=commit_order, defer_repeats=defer_repeats,
    )
