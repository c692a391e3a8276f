"""Prompt batching shared by the decoders: validation, length-sorted batches, left padding.

Why left padding: every row's last prompt token then sits in the same column, so the next
token (AR) or the next block (diffusion) of all rows is written at one common offset and a
batch advances with one tensor op per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def validate_prompts(prompt_ids: Sequence[Sequence[int]], batch_size: int, max_new_tokens: int) -> None:
    """Refuse inputs no decoder can serve, with a message naming the offending value."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    empty = [i for i, p in enumerate(prompt_ids) if len(p) == 0]
    if empty:
        raise ValueError(f"prompts must hold at least one token; empty prompt(s) at index {empty[:10]}")


def stop_set(eos_id: int | None, stop_ids: Iterable[int]) -> frozenset[int]:
    """Token ids that end a sequence (``eos_id=None`` and no stop ids: run to the length limit)."""
    stops = set(int(s) for s in stop_ids)
    if eos_id is not None:
        stops.add(int(eos_id))
    return frozenset(stops)


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (longest first), so padding is small."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def left_pad(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, mask)`` of shape ``(n, max_len)``: rows right-aligned, mask 1 on real tokens."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (pads get 0), as a left-padded row needs."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def cut_at_stop(tokens: Sequence[int], stops: frozenset[int]) -> list[int]:
    """Tokens up to and including the first stop token (all of them when none occurs)."""
    out: list[int] = []
    for tok in tokens:
        out.append(int(tok))
        if tok in stops:
            break
    return out
