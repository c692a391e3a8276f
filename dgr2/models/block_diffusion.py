"""A block-diffusion LM that *is* the AR checkpoint: same transformers module, same weights.

Conversion copies nothing and adds no parameter: :class:`BlockDiffusionLM` wraps the causal
LM and changes only what it is fed - a ``[MASK]`` token, a custom 4D attention mask and
explicit position ids.  The completion is cut into blocks of ``B`` tokens aligned from its
first token; attention is bidirectional inside a block and causal across blocks, and the
prompt is ordinary causal context (see :mod:`dgr2.models.block_mask` for the exact rule).

Prediction shift (AR compatible)
    The logit for completion token ``j`` is read at the position just before it, exactly as
    in the AR model, so the LM head is reused unchanged.  Inside a block, token ``j`` is read
    at the noisy token ``j - 1`` of the same block.  For the *first* token of a block there is
    no earlier token in the block: its logit is read at the last token of the previous
    *clean* block (the last prompt token for block 0).  That position never sees the block it
    predicts into, so the first token of every block is predicted exactly like AR decoding.

Training layout (one forward pass per batch, all blocks at once)
    Columns ``[prompt (Lp, left padded) | clean completion (Lc) | noisy completion (Lc)]``,
    completions right padded.  The clean stream is the true completion attending
    block-causally (its own block bidirectionally, earlier blocks, the prompt) - exactly the
    KV cache a decoder builds from committed blocks.  The noisy stream is the completion with
    some tokens replaced by ``[MASK]``; noisy block ``b`` sees the prompt, clean blocks
    ``< b`` and itself bidirectionally, never another noisy block.  Noisy tokens get the
    position ids of the clean tokens they stand for (``prompt_len + j``), so RoPE sees the
    same geometry as at decoding time.  Logit sources: completion token ``j`` reads column
    ``Lp + j - 1`` (clean stream; ``Lp - 1`` is the last prompt token) when ``j % B == 0``,
    else column ``Lp + Lc + j - 1`` (noisy stream).  Because prompts are left padded and
    completions start at the same column in every row, these columns are shared by the batch
    and only ``Lc`` positions go through the LM head.  The last clean block is context for
    no one; it is kept so the layout stays one fixed shape.

With ``B = 1`` every prediction is read from the clean stream, whose attention is then plain
causal attention: the logits equal the AR model's exactly (a test checks this).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from dgr2.config import DiffusionConfig
from dgr2.models.ar import load_model
from dgr2.models.block_mask import TokenKind, TokenLayout, additive_mask, allowed_attention
from dgr2.models.mask_schedule import SCHEDULES, MaskSchedule, sample_block_masks

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 1, 64  # 1 is the AR-equivalent degenerate case
SUPPORTED_ATTENTION = ("eager", "sdpa")  # implementations that take a custom 4D float mask
LossWeighting = Literal["inverse_t", "none"]
META_FILE = "block_diffusion.json"


def validate_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(
            f"block_size must be an int in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE} (paper: 32), got {block_size!r}"
        )


def require_mask_capable_attention(ar: PreTrainedModel) -> None:
    """Refuse attention kernels that would ignore (flash) or misread (flex) our 4D float mask."""
    attn = getattr(ar.config, "_attn_implementation", None)
    if attn not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {attn!r} cannot take a custom 4D block mask; "
            f"load the model with attn_implementation in {SUPPORTED_ATTENTION}"
        )


def mask_id_from_tokenizer(tokenizer) -> int:
    """The ``[MASK]`` id of a HF tokenizer (``dgr2.tokenizer`` sets ``mask_token=<mask>``)."""
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is None:
        raise ValueError("tokenizer has no mask token; block diffusion needs one (format.MASK = '<mask>')")
    return int(mask_id)


@dataclass(frozen=True)
class DiffusionBatch:
    """Prompts left padded, completions right padded; all ``(batch, length)`` tensors.

    ``loss_mask`` marks the completion tokens that carry loss (and may be masked); it must lie
    inside ``completion_mask``.  Unsupervised completion tokens stay clean context.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_ids.shape != self.prompt_mask.shape:
            raise ValueError("prompt_ids and prompt_mask must have the same shape")
        if not (self.completion_ids.shape == self.completion_mask.shape == self.loss_mask.shape):
            raise ValueError("completion_ids, completion_mask and loss_mask must have the same shape")
        if self.prompt_ids.shape[0] != self.completion_ids.shape[0]:
            raise ValueError("prompts and completions must have the same batch size")
        pm, cm = self.prompt_mask.bool(), self.completion_mask.bool()
        if not bool(pm[:, -1].all()) or bool((pm[:, 1:] < pm[:, :-1]).any()):
            raise ValueError("prompts must be left padded with at least one real token per row")
        if bool((cm[:, 1:] > cm[:, :-1]).any()):
            raise ValueError("completions must be right padded (real tokens first)")
        if bool((self.loss_mask.bool() & ~cm).any()):
            raise ValueError("loss_mask marks padding tokens; it must lie inside completion_mask")

    @classmethod
    def collate(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        pad_id: int,
        loss_masks: Sequence[Sequence[bool]] | None = None,
        device: torch.device | str = "cpu",
    ) -> "DiffusionBatch":
        """Pad token lists into a batch (loss on every completion token unless ``loss_masks``)."""
        if len(prompts) != len(completions) or not prompts:
            raise ValueError(f"need equal, non-zero numbers of prompts and completions, got {len(prompts)}/{len(completions)}")
        if loss_masks is not None and [len(m) for m in loss_masks] != [len(c) for c in completions]:
            raise ValueError("each loss mask must have its completion's length")
        lp, lc = max(len(p) for p in prompts), max(1, max(len(c) for c in completions))
        n = len(prompts)
        prompt_ids = torch.full((n, lp), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros((n, lp), dtype=torch.long)
        completion_ids = torch.full((n, lc), pad_id, dtype=torch.long)
        completion_mask = torch.zeros((n, lc), dtype=torch.long)
        loss_mask = torch.zeros((n, lc), dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            if p:
                prompt_ids[i, lp - len(p) :] = torch.tensor(list(p))
                prompt_mask[i, lp - len(p) :] = 1
            if c:
                completion_ids[i, : len(c)] = torch.tensor(list(c))
                completion_mask[i, : len(c)] = 1
                loss_mask[i, : len(c)] = torch.tensor(list(loss_masks[i])) if loss_masks is not None else True
        return cls(*(t.to(device) for t in (prompt_ids, prompt_mask, completion_ids, completion_mask, loss_mask)))


@dataclass
class DiffusionLossOutput:
    loss: torch.Tensor
    masked_tokens: int
    supervised_tokens: int


@dataclass(frozen=True)
class TrainingLayout:
    """The concatenated model input of one batch (see module docstring)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    tokens: TokenLayout
    logit_columns: torch.Tensor  # (Lc,) column whose output predicts completion token j


class BlockDiffusionLM(nn.Module):
    """Block-diffusion view of a HF causal LM (Qwen2, Llama); ``ar`` keeps the weights."""

    def __init__(
        self,
        ar: PreTrainedModel,
        *,
        mask_id: int,
        block_size: int = 32,
        mask_schedule: MaskSchedule = "uniform",
        mask_eps: float = 1e-3,
        loss_weighting: LossWeighting = "inverse_t",
        suffix_mask_prob: float = 0.0,
    ):
        super().__init__()
        validate_block_size(block_size)
        vocab = ar.get_input_embeddings().num_embeddings
        if not 0 <= mask_id < vocab:
            raise ValueError(f"mask_id {mask_id} outside the model vocabulary (0..{vocab - 1})")
        require_mask_capable_attention(ar)
        if mask_schedule not in SCHEDULES:
            raise ValueError(f"unknown mask schedule {mask_schedule!r}; choose one of {SCHEDULES}")
        if not 0.0 < mask_eps < 1.0:
            raise ValueError(f"mask_eps must be in (0, 1), got {mask_eps}")
        if loss_weighting not in ("inverse_t", "none"):
            raise ValueError(f"loss_weighting must be 'inverse_t' or 'none', got {loss_weighting!r}")
        if not 0.0 <= suffix_mask_prob <= 1.0:
            raise ValueError(f"suffix_mask_prob must be in [0, 1], got {suffix_mask_prob}")
        self.ar = ar
        self.mask_id = int(mask_id)
        self.block_size = block_size
        self.mask_schedule: MaskSchedule = mask_schedule
        self.mask_eps = mask_eps
        self.loss_weighting: LossWeighting = loss_weighting
        self.suffix_mask_prob = float(suffix_mask_prob)

    @classmethod
    def from_config(cls, ar: PreTrainedModel, cfg: DiffusionConfig, mask_id: int) -> "BlockDiffusionLM":
        return cls(
            ar, mask_id=mask_id, block_size=cfg.block_size, mask_schedule=cfg.mask_schedule,
            mask_eps=cfg.mask_eps, loss_weighting=cfg.loss_weighting, suffix_mask_prob=cfg.suffix_mask_prob,
        )

    # ------------------------------------------------------------------ layout and logits
    def training_layout(self, batch: DiffusionBatch, noisy_ids: torch.Tensor) -> TrainingLayout:
        """``[prompt | clean | noisy]`` ids, position ids, token metadata and logit columns."""
        n, lp = batch.prompt_ids.shape
        lc = batch.completion_ids.shape[1]
        device = batch.prompt_ids.device
        pm, cm = batch.prompt_mask.bool(), batch.completion_mask.bool()
        j = torch.arange(lc, device=device)
        prompt_pos = (pm.long().cumsum(1) - 1).clamp(min=0)
        completion_pos = pm.long().sum(1, keepdim=True) + j
        pad, prompt, clean, noisy = (int(k) for k in (TokenKind.PAD, TokenKind.PROMPT, TokenKind.CLEAN, TokenKind.NOISY))
        kind = torch.cat(
            [
                torch.where(pm, prompt, pad),
                torch.where(cm, clean, pad),
                torch.where(cm, noisy, pad),
            ],
            1,
        )
        comp_block = (j // self.block_size).expand(n, lc)
        block = torch.cat([torch.full((n, lp), -1, device=device), comp_block, comp_block], 1)
        slot = torch.arange(lp + 2 * lc, device=device).expand(n, -1)
        first_in_block = j % self.block_size == 0
        logit_columns = torch.where(first_in_block, lp + j - 1, lp + lc + j - 1)
        return TrainingLayout(
            input_ids=torch.cat([batch.prompt_ids, batch.completion_ids, noisy_ids], 1),
            position_ids=torch.cat([prompt_pos, completion_pos, completion_pos], 1),
            tokens=TokenLayout(kind.long(), block.long(), slot.contiguous()),
            logit_columns=logit_columns,
        )

    def shifted_logits(
        self, batch: DiffusionBatch, noisy_ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``(batch, Lc, vocab)``: the model's prediction for each completion token given the
        clean earlier blocks and the noisy version of its own block (one forward pass).

        ``positions`` (bool ``(batch, Lc)``) returns only those rows, ``(n, vocab)``: the LM head
        then runs on n hidden states instead of batch * Lc, which is what keeps the RL replay
        (one graph per unmasking step, each scoring a few committed tokens) from holding a
        full-vocabulary tensor per step.
        """
        layout = self.training_layout(batch, noisy_ids)
        mask = additive_mask(allowed_attention(layout.tokens, layout.tokens), self.ar.dtype)
        if positions is None:
            out = self.ar(
                input_ids=layout.input_ids,
                attention_mask=mask,
                position_ids=layout.position_ids,
                use_cache=False,
                logits_to_keep=layout.logit_columns,
            )
            return out.logits
        hidden = self.ar.get_decoder()(
            input_ids=layout.input_ids, attention_mask=mask, position_ids=layout.position_ids, use_cache=False,
        ).last_hidden_state
        return self.ar.get_output_embeddings()(hidden[:, layout.logit_columns][positions])

    # ------------------------------------------------------------------ objective
    def forward(self, batch: DiffusionBatch, generator: torch.Generator | None = None) -> DiffusionLossOutput:
        """The training objective (so a DeepSpeed engine can call the module directly)."""
        return self.diffusion_loss(batch, generator=generator)

    def diffusion_loss(
        self, batch: DiffusionBatch, generator: torch.Generator | None = None, token_weights: torch.Tensor | None = None,
    ) -> DiffusionLossOutput:
        """Mask each completion block independently (ratio from the schedule), predict it.

        Loss is cross-entropy on masked supervised tokens only.  ``inverse_t`` weights each
        masked token by ``1 / t`` (its block's realised mask ratio) and divides by the number
        of supervised tokens: the masked-diffusion ELBO, an unbiased estimate of the any-order
        per-token NLL.  ``none`` is the mean CE over masked tokens (lower variance, biased
        towards heavily masked blocks).  ``token_weights`` (``(batch, Lc)``, positive) weighs
        tokens unequally, e.g. the ranking sections (:mod:`dgr2.train.focus`); the counts in both
        denominators become sums of weights, so all-ones weights give the unweighted loss.
        """
        masked, ratio = sample_block_masks(
            batch.loss_mask.bool(), self.block_size, self.mask_schedule, self.mask_eps, generator,
            suffix_prob=self.suffix_mask_prob,
        )
        return self.loss_from_masks(batch, masked, ratio, token_weights)

    def loss_from_masks(
        self, batch: DiffusionBatch, masked: torch.Tensor, ratio: torch.Tensor, token_weights: torch.Tensor | None = None,
    ) -> DiffusionLossOutput:
        """The objective for a given choice of masked tokens (what ``diffusion_loss`` samples)."""
        supervised = batch.loss_mask.bool()
        if bool((masked & ~supervised).any()):
            raise ValueError("masked tokens must be supervised completion tokens")
        if token_weights is not None:
            if token_weights.shape != masked.shape:
                raise ValueError(f"token_weights must have the completion's shape {tuple(masked.shape)}, "
                                 f"got {tuple(token_weights.shape)}")
            if bool((token_weights[supervised] <= 0).any()):
                raise ValueError("token_weights must be positive on supervised tokens")
        n_supervised, n_masked = int(supervised.sum()), int(masked.sum())
        if n_masked == 0:
            raise ValueError("batch has no supervised completion token to mask (empty loss)")
        noisy_ids = torch.where(masked, torch.full_like(batch.completion_ids, self.mask_id), batch.completion_ids)
        # the LM head (a ~9k-token vocabulary on the beauty profile) runs at the masked slots only:
        # the others carry no loss, and the full (batch, Lc, vocab) logits, their log-softmax and
        # its backward were about a third of a CFT step on the CPU
        logits = self.shifted_logits(batch, noisy_ids, positions=masked)
        ce = F.cross_entropy(logits.float(), batch.completion_ids[masked], reduction="none")
        if token_weights is None:
            per_token, supervised_weight, masked_weight = ce, float(n_supervised), float(n_masked)
        else:
            w = token_weights.to(ce.dtype)
            per_token, supervised_weight, masked_weight = ce * w[masked], w[supervised].sum(), w[masked].sum()
        if self.loss_weighting == "inverse_t":
            loss = (per_token / ratio[masked]).sum() / supervised_weight
        else:
            loss = per_token.sum() / masked_weight
        return DiffusionLossOutput(loss=loss, masked_tokens=n_masked, supervised_tokens=n_supervised)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, path: str | Path) -> None:
        """A plain HF checkpoint (loadable as the AR model) plus the diffusion settings."""
        path = Path(path)
        self.ar.save_pretrained(path, safe_serialization=True)
        meta = {
            "mask_id": self.mask_id, "block_size": self.block_size, "mask_schedule": self.mask_schedule,
            "mask_eps": self.mask_eps, "loss_weighting": self.loss_weighting, "suffix_mask_prob": self.suffix_mask_prob,
        }
        (path / META_FILE).write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> "BlockDiffusionLM":
        path = Path(path)
        meta_path = path / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{path} has no {META_FILE}; it is not a block-diffusion checkpoint")
        return cls(load_model(path, device), **json.loads(meta_path.read_text()))
