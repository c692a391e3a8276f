"""How decoders borrow a model: eval mode and no autograd for the call, then put back.

Why restore the mode: RL and OPD decode rollouts from a model that is being trained; a decoder
that left the model in eval mode (or in train mode, with dropout on while decoding) would
silently change the next training step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def decoding_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode plus ``torch.inference_mode`` for the duration; the training flag is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


# causal LMs whose logits are exactly ``lm_head(decoder(...).last_hidden_state)``: no logit
# scale or soft-capping after the head (Gemma, Cohere, ... post-process and are not listed)
_PLAIN_HEAD_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def split_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(decoder, lm_head)`` of a causal LM whose logits are the head applied to the decoder's
    final hidden states, else None (the caller then takes the model's own logits).

    Why: a block decoder that reads the hidden states can run the head on only the slots its
    commit rule looks at (:class:`dgr2.decoding.block_loop.SlotLogits`)."""
    if getattr(model.config, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if decoder is None or not isinstance(head, nn.Linear):
        return None
    return decoder, head
