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
runs only at the slots the loop asks for (those still masked in some row), and for the
architectures :func:`dgr2.decoding.runtime.split_head` knows, only when the commit rule reads
them (:class:`dgr2.decoding.block_loop.SlotLogits`); for the Llama family the last layer too
runs only at the slots read (:mod:`dgr2.decoding.last_layer`).  The attention mask of a block's
later steps is the same at every step (same cached prefix, same noisy block): it is the noisy rows
of the block's first-step mask, taken once a block.  The cache writes in place, and a later step of
a batch runs only the rows whose block is still open, over a read-only view of their cache
(:mod:`dgr2.decoding.kv_cache`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from functools import partial

import torch
from transformers import Cache, PreTrainedModel

from dgr2.decoding.batching import left_pad, positions_from_mask
from dgr2.decoding.block_layout import block_layout, empty_layout, prompt_layout
from dgr2.decoding.block_loop import BlockDecodeSettings, SlotLogits, decode_blocks, unwrap
from dgr2.decoding.commit import CommitOrder
from dgr2.decoding import last_layer
from dgr2.decoding.kv_cache import decoding_cache, supports_rows_view
from dgr2.decoding.last_layer import LastLayerReader, reading_last_layer
from dgr2.decoding.output import DecodeOutput
from dgr2.decoding.runtime import model_device, split_head
from dgr2.models.block_diffusion import BlockDiffusionLM
from dgr2.models.block_mask import TokenKind, TokenLayout, additive_mask, allowed_attention


# slots a greedy left-to-right step reads at a time (decode_blocks' head_chunk); measured on the
# beauty model at batch 1 on 2 CPU cores, see DiffusionConfig.head_chunk
DEFAULT_HEAD_CHUNK = 8


class DeferredSlotStates:
    """A pass's slot states read through a :class:`LastLayerReader`: each read runs the last
    layer at just those slots (:class:`dgr2.decoding.block_loop.SlotStates`).

    ``columns``: the pass's query column of each slot (after ``first``, when given: slot 0's
    state kept from the block's first step); ``computed``: the batch rows the pass ran, of
    ``n_rows`` (None: all of them)."""

    def __init__(self, reader: LastLayerReader, columns: torch.Tensor, n_rows: int,
                 computed: torch.Tensor | None = None, first: torch.Tensor | None = None):
        self.reader, self.pass_index = reader, reader.passes
        self.cols, self.n_rows, self.computed, self.first = columns, n_rows, computed, first
        self.position: torch.Tensor | None = None
        if computed is not None:  # full-batch row -> row of the pass
            self.position = torch.full((n_rows,), -1, dtype=torch.long, device=columns.device)
            self.position[computed] = torch.arange(len(computed), device=columns.device)

    def __len__(self) -> int:
        return len(self.cols) + (self.first is not None)

    def columns(self, start: int, end: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        parts = []
        lo, hi = start, end
        if self.first is not None:
            if start == 0 and end > 0:
                parts.append(self.first if rows is None else self.first[rows])
            lo, hi = max(start, 1) - 1, end - 1
        if hi > lo:
            parts.append(self._read(self.cols[lo:hi], rows))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _read(self, cols: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if self.computed is None:
            return self.reader.read(cols, rows, pass_index=self.pass_index)
        if rows is not None:  # the caller reads only rows the pass ran
            return self.reader.read(cols, self.position[rows], pass_index=self.pass_index)
        part = self.reader.read(cols, None, pass_index=self.pass_index)
        return part.new_zeros((self.n_rows, *part.shape[1:])).index_copy_(0, self.computed, part)


class CachedBlockPredictor:
    """Step logits from one forward over the current block against a KV cache of the prefix.

    ``reader``: the model's last layer wrapped by :func:`reading_last_layer` (None: the whole
    last layer runs at every query)."""

    def __init__(self, model: PreTrainedModel, prompts: list[Sequence[int]], settings: BlockDecodeSettings,
                 reader: LastLayerReader | None = None):
        self.model = model
        self.settings = settings
        self.device = model_device(model)
        self.split = split_head(model)
        self.reader = reader if self.split else None
        ids, mask = left_pad(prompts, settings.pad_id, self.device)
        self.prompt_len = mask.sum(1)
        # room for the padded prompt, every completed block and the noisy block on top
        self.cache = decoding_cache(model, capacity=ids.shape[1] + settings.max_new_tokens + settings.block_size)
        self.cached = empty_layout(len(prompts), self.device)
        # tokens to write into the cache with the next step (the prompt, then each finished block)
        self.pending: tuple[torch.Tensor, torch.Tensor, TokenLayout] | None = (
            ids, positions_from_mask(mask), prompt_layout(mask)
        )
        self.first: torch.Tensor | None = None  # slot 0's hidden state (or logits), fixed within a block
        self.step_mask: torch.Tensor | None = None  # the block's later steps' attention mask
        self.block_index = 0
        self.length = 0
        self.block_pos = torch.empty(0)

    def begin_block(self, block_index: int, length: int) -> None:
        self.block_index, self.length = block_index, length
        self.step_mask = None
        offsets = block_index * self.settings.block_size + torch.arange(length, device=self.device)
        self.block_pos = self.prompt_len[:, None] + offsets

    def block_logits(self, block: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor | None = None) -> SlotLogits:
        n_rows, length = block.shape
        if self.pending is not None:
            ids, pos, layout = self.pending
            noisy = block_layout(n_rows, length, TokenKind.NOISY, self.block_index, self.cached.length + layout.length, self.device)
            keep = layout.length - 1 + slots  # slot i is read at the query before it (slot 0: last clean token)
            mask = self._mask(layout.cat(noisy))
            # the later steps' queries (the noisy block) and keys (this cache + the block) are this
            # pass's last rows: their mask is that part of this one
            self.step_mask = mask[:, :, -length:].contiguous()
            out = self._forward(torch.cat([ids, block], 1), torch.cat([pos, self.block_pos], 1), mask, keep)
            self.cached = self.cached.cat(layout)
            self.pending = None
            if int(slots[0]) != 0:
                raise RuntimeError("the first step of a block must predict slot 0")
            if out is None:  # deferred: slot 0's state now (kept for the block), the rest when read
                self.first = self.reader.read(keep[:1], pass_index=self.reader.passes)
                return self._slot_logits(DeferredSlotStates(self.reader, keep[1:], n_rows, first=self.first))
            self.first = out[:, :1]
            return self._slot_logits(out)
        later = slots[slots > 0]
        computed = None  # the batch rows this pass runs (None: all)
        if rows is not None and len(rows) < n_rows and supports_rows_view(self.cache):
            # only the rows still open in this block: the others' predictions are never read
            computed = rows
            out = self._forward(block[rows], self.block_pos[rows], self.step_mask[rows], later - 1,
                                cache=self.cache.rows_view(rows))
        else:
            out = self._forward(block, self.block_pos, self.step_mask, later - 1)
        first = self.first if int(slots[0]) == 0 else None
        if out is None:
            return self._slot_logits(DeferredSlotStates(self.reader, later - 1, n_rows, computed, first))
        if computed is not None:
            out = out.new_zeros((n_rows, *out.shape[1:])).index_copy_(0, computed, out)
        return self._slot_logits(out if first is None else torch.cat([first, out], 1))

    def end_block(self, block: torch.Tensor, keep: torch.Tensor) -> None:
        if len(keep) < self.prompt_len.shape[0]:
            self.cache.batch_select_indices(keep)
            self.cached = self.cached.rows(keep)
            self.prompt_len, self.block_pos = self.prompt_len[keep], self.block_pos[keep]
        layout = block_layout(len(keep), self.length, TokenKind.CLEAN, self.block_index, self.cached.length, self.device)
        self.pending = (block, self.block_pos, layout)

    def _mask(self, queries: TokenLayout) -> torch.Tensor:
        """Additive mask of ``queries`` over the cached prefix and themselves (the training rule)."""
        return additive_mask(allowed_attention(queries, self.cached.cat(queries)), self.model.dtype)

    def _slot_logits(self, out: torch.Tensor | DeferredSlotStates) -> SlotLogits:
        return SlotLogits(states=out, head=self.split[1]) if self.split else SlotLogits(logits=out)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor,
                 cache: Cache | None = None) -> torch.Tensor | None:
        """Run ``ids`` against the cache, keep their clean part, drop the noisy block; returns
        the final hidden states at columns ``keep`` when the head splits off, else the logits,
        or None when the pass deferred its last layer (the states are then read through
        ``self.reader`` until the next pass).  ``cache``: a rows view of the cache
        (:meth:`KVCache.rows_view`), which keeps nothing."""
        view = cache is not None
        cache = cache if view else self.cache
        if self.reader is not None and ids.numel() >= last_layer.MIN_DEFERRED_QUERIES:
            self.reader.deferred = True
            try:
                self.split[0](input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
            finally:
                self.reader.deferred = False
            if not view:
                self.cache.crop(-self.length)
            return None
        if self.split:
            hidden = self.split[0](input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache,
                                   use_cache=True).last_hidden_state[:, keep]
        else:
            hidden = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                                logits_to_keep=keep).logits
        if not view:
            self.cache.crop(-self.length)
        return hidden


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
    head_chunk: int = DEFAULT_HEAD_CHUNK,
    defer_last_layer: bool = True,
    strict_threshold: float | None = None,
    strict_after: Iterable[int] = (),
) -> DecodeOutput:
    """Block-diffusion continuations (new tokens only, cut after the first stop, inclusive).

    ``eos_id=None`` with no ``stop_ids`` produces exactly ``max_new_tokens`` per prompt.
    ``head_chunk``: see :func:`dgr2.decoding.block_loop.decode_blocks` (same output at any value);
    ``strict_threshold`` / ``strict_after``: the strict-section bar (:mod:`dgr2.decoding.commit`).
    ``defer_last_layer``: run the last layer only at the slots read, in passes large enough for
    it to pay and where the architecture allows (:mod:`dgr2.decoding.last_layer`; same tokens
    either way, False is for comparisons).
    """
    with reading_last_layer(unwrap(model)) if defer_last_layer else nullcontext() as reader:
        return decode_blocks(
            model, prompt_ids, partial(CachedBlockPredictor, reader=reader), block_size=block_size,
            max_steps_per_block=max_steps_per_block, threshold=threshold, max_new_tokens=max_new_tokens,
            mask_id=mask_id, eos_id=eos_id, pad_id=pad_id, stop_ids=stop_ids, batch_size=batch_size,
            temperature=temperature, seed=seed, commit_order=commit_order, defer_repeats=defer_repeats,
            head_chunk=head_chunk, strict_threshold=strict_threshold, strict_after=strict_after,
        )
