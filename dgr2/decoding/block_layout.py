"""Token metadata for the pieces a block decoder feeds the model (prompt, clean or noisy block).

Decoders pass the metadata of everything already in the KV cache as extra keys, so the one
rule in :mod:`dgr2.models.block_mask` decides attention at inference exactly as in training.
"""

from __future__ import annotations

import torch

from dgr2.models.block_mask import TokenKind, TokenLayout


def prompt_layout(mask: torch.Tensor, first_slot: int = 0) -> TokenLayout:
    """Left-padded prompt rows: pads are PAD tokens, real tokens PROMPT."""
    n, length = mask.shape
    kind = torch.where(mask.bool(), int(TokenKind.PROMPT), int(TokenKind.PAD)).long()
    block = torch.full((n, length), -1, dtype=torch.long, device=mask.device)
    slot = (first_slot + torch.arange(length, device=mask.device)).expand(n, -1).contiguous()
    return TokenLayout(kind, block, slot)


def block_layout(rows: int, length: int, kind: TokenKind, block_index: int, first_slot: int, device) -> TokenLayout:
    """A completion block of ``length`` tokens (all rows decode the same block index)."""
    shape = (rows, length)
    slot = (first_slot + torch.arange(length, device=device)).expand(rows, -1).contiguous()
    return TokenLayout(
        torch.full(shape, int(kind), dtype=torch.long, device=device),
        torch.full(shape, block_index, dtype=torch.long, device=device),
        slot,
    )


def empty_layout(rows: int, device) -> TokenLayout:
    empty = torch.zeros((rows, 0), dtype=torch.long, device=device)
    return TokenLayout(empty, empty.clone(), empty.clone())
