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
