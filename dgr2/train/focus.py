"""Per-token loss weights for the ranking sections of a completion (OPD and CFT alike).

Why a weight at all: a ranking is invalid as soon as one label of the ``order`` section or the
answer is wrong, while those ~44 tokens are about a fifth of a 200-token completion; an
unweighted token mean spends most of its gradient on the evidence lines before them.
"""

from __future__ import annotations

import torch


def focus_token_id(tokenizer, word: str, field: str = "opd.focus_token") -> int:
    """The id of ``word`` as one token of ``tokenizer``; a clear error naming the config
    ``field`` when it is not one (a word the tokenizer splits would silently weigh nothing)."""
    ids = tokenizer.convert_tokens_to_ids([word])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"{field} {word!r} is not a single token of this tokenizer; "
                         "name a word of the trace grammar (e.g. '<answer>' or 'order')")
    return int(ids[0])


def focus_weights(completion_ids: torch.Tensor, token_id: int | None, weight: float) -> torch.Tensor:
    """``(batch, Lc)`` per-token weights: ``weight`` from the first ``token_id`` of each row on
    (that token included), 1 before it and on rows without it."""
    ones = torch.ones(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    if token_id is None or weight == 1.0:
        return ones
    after = (completion_ids == token_id).long().cumsum(1) > 0
    return torch.where(after, torch.full_like(ones, weight), ones)
