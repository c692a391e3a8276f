"""Who may attend to whom in a block-diffusion sequence, as one rule over token metadata.

Every token carries three integers: its ``kind`` (pad, prompt, clean completion, noisy
completion), its completion ``block`` index (``-1`` outside the completion) and its ``slot``
(its column in the layout; also the order of the KV cache).  A query attends to a key when:

========  ==============================================================================
query     keys it sees
========  ==============================================================================
prompt    prompt keys at slots <= its own (plain causal attention)
clean     every prompt key; clean keys of blocks <= its own (bidirectional in its block)
noisy     every prompt key; clean keys of blocks < its own; noisy keys of its own block
pad       only itself (a row with no visible key would turn softmax into NaN)
========  ==============================================================================

No query ever sees a pad key.  Training and decoding build their masks from this one rule
(decoding passes the metadata of the cached prefix as extra keys), so the attention a block
gets at inference is by construction the one it was trained with.  With a block size of 1
the clean rule reduces to causal attention, which is what makes the conversion exact there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class TokenKind(IntEnum):
    PAD = 0
    PROMPT = 1
    CLEAN = 2
    NOISY = 3


@dataclass(frozen=True)
class TokenLayout:
    """Per-token ``kind``, ``block`` and ``slot``, each a ``(batch, length)`` long tensor."""

    kind: torch.Tensor
    block: torch.Tensor
    slot: torch.Tensor

    def __post_init__(self) -> None:
        if not (self.kind.shape == self.block.shape == self.slot.shape) or self.kind.dim() != 2:
            raise ValueError(
                f"kind/block/slot must be equal (batch, length) tensors, got "
                f"{tuple(self.kind.shape)}, {tuple(self.block.shape)}, {tuple(self.slot.shape)}"
            )

    @property
    def length(self) -> int:
        return self.kind.shape[1]

    def cat(self, other: "TokenLayout") -> "TokenLayout":
        """This layout followed by ``other`` along the sequence (cache prefix + new tokens)."""
        return TokenLayout(
            torch.cat([self.kind, other.kind], 1),
            torch.cat([self.block, other.block], 1),
            torch.cat([self.slot, other.slot], 1),
        )

    def rows(self, index: torch.Tensor) -> "TokenLayout":
        """Keep only these batch rows (sequences that are still being decoded)."""
        return TokenLayout(self.kind[index], self.block[index], self.slot[index])


def allowed_attention(queries: TokenLayout, keys: TokenLayout) -> torch.Tensor:
    """Boolean ``(batch, n_queries, n_keys)``: True where the query may attend to the key."""
    qk, qb, qs = (t[:, :, None] for t in (queries.kind, queries.block, queries.slot))
    kk, kb, ks = (t[:, None, :] for t in (keys.kind, keys.block, keys.slot))
    key_prompt = kk == TokenKind.PROMPT
    key_clean = kk == TokenKind.CLEAN
    sees_prompt_query = key_prompt & (ks <= qs)
    sees_clean_query = key_prompt | (key_clean & (kb <= qb))
    sees_noisy_query = key_prompt | (key_clean & (kb < qb)) | ((kk == TokenKind.NOISY) & (kb == qb))
    itself = qs == ks
    return torch.where(
        qk == TokenKind.PROMPT,
        sees_prompt_query,
        torch.where(qk == TokenKind.CLEAN, sees_clean_query, torch.where(qk == TokenKind.NOISY, sees_noisy_query, itself)),
    )


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(batch, 1, q, k)`` float mask, 0 where allowed and the dtype's minimum elsewhere.

    Why additive float rather than boolean: transformers 5 passes a ready 4D mask unchanged to
    the attention function; ``eager`` adds it to the scores and ``sdpa`` accepts a float mask
    as well, so one mask serves both implementations.
    """
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def render(allowed: torch.Tensor) -> list[str]:
    """One row per query, ``'1'``/``'.'`` per key: a readable form of one example's mask."""
    if allowed.dim() != 2:
        raise ValueError(f"render takes one example's (q, k) mask, got shape {tuple(allowed.shape)}")
    return ["".join("1" if v else "." for v in row.tolist()) for row in allowed]
