"""Loss functions a training stage can plug into the harness, by name.

Each takes the DeepSpeed engine (callable like the wrapped model), a collated batch and the
stage's extra settings, and returns ``(loss, stats)``; ``stats`` holds token counts that the
harness sums across workers for tokens/s.  Later stages (CFT/OPD/RL) register here too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dgr2.train.batches import IGNORE_INDEX

LossFn = Callable[[Any, dict[str, torch.Tensor], dict[str, Any]], tuple[torch.Tensor, dict[str, float]]]
LOSSES: dict[str, LossFn] = {}


def register(name: str) -> Callable[[LossFn], LossFn]:
    def wrap(fn: LossFn) -> LossFn:
        LOSSES[name] = fn
        return fn

    return wrap


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise KeyError(f"unknown loss {name!r}; registered: {sorted(LOSSES)}")
    return LOSSES[name]


@register("sft")
def sft_loss(model, batch: dict[str, torch.Tensor], extra: dict[str, Any]):
    """Next-token cross-entropy on completion tokens only (prompt and padding are -100)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = out.logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )
    stats = {
        "tokens": float(batch["attention_mask"].sum()),
        "target_tokens": float((labels != IGNORE_INDEX).sum()),
    }
    return loss, stats
