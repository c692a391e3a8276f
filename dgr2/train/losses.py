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
    """Next-token cross-entropy on completion tokens only (prompt and padding are -100).

    The LM head runs only at positions whose next token is supervised: with a vocabulary of
    ~9k SID tokens the head costs as much as the whole tiny backbone, and ~40% of positions
    are prompt.
    """
    module = getattr(model, "module", model)  # DeepSpeed engine -> the HF model
    hidden = module.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    logits = module.get_output_embeddings()(hidden[:, :-1][keep]).float()
    loss = torch.nn.functional.cross_entropy(logits, labels[keep])
    stats = {"tokens": float(batch["attention_mask"].sum()), "target_tokens": float(keep.sum())}
    return loss, stats
