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


def diffusion_batch_from_rows(batch: dict[str, torch.Tensor], pad_id: int):
    """Right-padded ``input_ids`` + ``prompt_len`` rows -> a :class:`DiffusionBatch`
    (prompts left padded, completions right padded, loss on every completion token)."""
    from dgr2.models.block_diffusion import DiffusionBatch

    ids, attn, plen = batch["input_ids"], batch["attention_mask"], batch["prompt_len"]
    lengths = attn.sum(1).tolist()
    rows = ids.tolist()
    prompts = [row[:p] for row, p in zip(rows, plen.tolist())]
    completions = [row[p:n] for row, p, n in zip(rows, plen.tolist(), lengths)]
    return DiffusionBatch.collate(prompts, completions, pad_id, device=ids.device)


@register("cft")
def cft_loss(model, batch: dict[str, torch.Tensor], extra: dict[str, Any]):
    """Block-diffusion masked-denoising loss on the completion (conversion fine-tuning).

    ``extra`` carries ``mask_id``, ``pad_id`` and the ``diffusion`` config section, and with
    ``cft.focus_weight`` != 1 ``focus_token_id``/``focus_weight`` (the ranking sections' weight);
    the model is the AR checkpoint seen through :class:`BlockDiffusionLM` (no new parameters).
    """
    from dgr2.models.block_diffusion import BlockDiffusionLM

    module = getattr(model, "module", model)
    d = extra["diffusion"]
    wrapper = BlockDiffusionLM(
        module, mask_id=int(extra["mask_id"]), block_size=int(d["block_size"]), mask_schedule=d["mask_schedule"],
        mask_eps=float(d["mask_eps"]), loss_weighting=d["loss_weighting"],
        suffix_mask_prob=float(d.get("suffix_mask_prob", 0.0)),
    )
    dbatch = diffusion_batch_from_rows(batch, int(extra["pad_id"]))
    weights = None
    if extra.get("focus_token_id") is not None:  # the pipeline sets it only at cft.focus_weight != 1
        from dgr2.train.focus import focus_weights

        weights = focus_weights(dbatch.completion_ids, int(extra["focus_token_id"]), float(extra["focus_weight"]))
    out = wrapper.diffusion_loss(dbatch, token_weights=weights)
    stats = {"tokens": float(batch["attention_mask"].sum()), "target_tokens": float(out.masked_tokens)}
    return out.loss, stats
