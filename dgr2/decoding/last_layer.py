"""Run a causal LM's last decoder layer only at the query columns a decoder reads.

Why: a block-diffusion pass feeds every slot of the block - and on a block's first step the
clean previous block as well (for block 0, the whole prompt) - because every slot's keys and
values shape the other slots' states.  Only the final hidden states at the slots the commit
rule reads leave the model, and in the *last* layer nothing downstream needs the other rows:
their keys and values are still computed (the read rows attend to them, and the clean ones go
into the KV cache), but their queries, attention, ``o_proj`` and MLP are not.  Under greedy
left-to-right commits a pass reads one 8-slot chunk of a 32-slot block most of the time
(:class:`dgr2.decoding.block_loop.SlotLogits`), so most of the last layer's arithmetic was
thrown away.  The result is exact: the read rows see the same keys, values, mask and
positions as in the full layer (``tests/test_last_layer.py`` checks states and decoded tokens).

How: :func:`reading_last_layer` swaps the decoder's last layer for a :class:`LastLayerReader`
for the duration of a decode.  Decoders defer only passes of at least
:data:`MIN_DEFERRED_QUERIES` query tokens: below that the saved arithmetic is smaller than the
cost of the extra small operations.  With ``reader.deferred = True`` a forward pass through the
decoder stops after the last layer's keys and values (stored in the cache as usual) and returns
no columns; :meth:`LastLayerReader.read` then computes the final, normed states of any columns
of that pass on demand, until the next pass.  With ``deferred = False`` the wrapped layer runs
as it is.  Only the layer shapes of the Llama family (Llama, Mistral, Qwen2, Qwen3: pre-norm,
rotary, ``q/k/v/o_proj``, optional ``q_norm``/``k_norm``) with full attention under ``sdpa`` or
``eager`` are handled; for any other model :func:`reading_last_layer` yields None and the
decoders run the whole layer.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dgr2.models.block_mask import additive_mask

# Fewest query tokens (batch rows x columns) a pass must have for deferring to pay.  Measured on
# 2 CPU cores, beauty-size model (hidden 128, 4 layers), reading 8 of 32 block slots a row, median
# pass time deferred vs whole: batch 1 2.29 vs 2.25 ms and batch 2 2.47 vs 2.48 ms (no gain: the
# extra small ops cancel the saved arithmetic), batch 4 3.33 vs 3.73, batch 16 9.25 vs 10.33,
# batch 64 31.4 vs 34.7, a 192-token prefill 3.83 vs 4.36.  On an accelerator a small pass is
# bound by memory and launches, not arithmetic, so the break-even is higher there (unmeasured).
MIN_DEFERRED_QUERIES = 128
_LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
_ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx")
# one decode at a time per model while its layer list is swapped (Serve runs batches in threads)
_SWAP_LOCKS: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _modeling_function(attn: nn.Module, name: str) -> Callable[..., Any]:
    """``name`` from the transformers modeling file that defines this attention class (each of
    the Llama family's files has its own ``rotate_half`` and ``eager_attention_forward``), so
    the deferred layer uses the very functions the whole layer uses."""
    return getattr(inspect.getmodule(type(attn)), name)


class LastLayerReader(nn.Module):
    """The last decoder layer, able to stop after its keys and values and compute the rest for
    chosen columns later (module docstring)."""

    def __init__(self, layer: nn.Module, final_norm: nn.Module, attn_implementation: str):
        super().__init__()
        self.layer = layer
        self.final_norm = final_norm
        attn = layer.self_attn
        # the functions the layer's own attention calls: transformers' sdpa one, or its modeling
        # file's eager one (which adds the mask, hence the additive masks below)
        self.attention = (_modeling_function(attn, "eager_attention_forward") if attn_implementation == "eager"
                          else ALL_ATTENTION_FUNCTIONS[attn_implementation])
        self.rotate_half = _modeling_function(attn, "rotate_half")
        self.deferred = False
        self.passes = 0  # deferred passes so far: a read names the pass it belongs to
        self._saved: tuple[torch.Tensor, ...] | None = None

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, cache: Any = None,
                **kwargs: Any) -> torch.Tensor:
        if not self.deferred:
            return self.layer(hidden_states, attention_mask=attention_mask, position_embeddings=position_embeddings,
                              cache=cache, **kwargs)
        if position_embeddings is None:
            raise RuntimeError("the deferred last layer needs the rotary tables the decoder passes down")
        attn = self.layer.self_attn
        normed = self.layer.input_layernorm(hidden_states)
        batch, length, _ = normed.shape
        keys = attn.k_proj(normed).view(batch, length, -1, attn.head_dim)
        if getattr(attn, "k_norm", None) is not None:
            keys = attn.k_norm(keys)
        values = attn.v_proj(normed).view(batch, length, -1, attn.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        keys = self._rotary(keys.transpose(1, 2), cos, sin)
        if cache is not None:
            keys, values = cache.update(keys, values, attn.layer_idx)
        if attention_mask is None:  # no padding, plain causal: spell it out, a subset of queries cannot use is_causal
            past = keys.shape[-2] - length
            allowed = torch.arange(keys.shape[-2], device=keys.device)[None, :] <= (
                past + torch.arange(length, device=keys.device)[:, None])
            attention_mask = additive_mask(allowed[None], hidden_states.dtype)
        elif attention_mask.dim() != 4:
            raise RuntimeError(f"the deferred last layer takes a 4D mask or none, got shape {tuple(attention_mask.shape)}")
        self.passes += 1
        self._saved = (hidden_states, normed, keys, values, cos, sin, attention_mask)
        return hidden_states[:, :0]

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``(batch, heads, seq, dim)`` rotated by ``(batch, seq, dim)`` tables: transformers'
        ``apply_rotary_pos_emb`` for one tensor (queries and keys are rotated at different times)."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (x * cos) + (self.rotate_half(x) * sin)

    def read(self, columns: torch.Tensor, rows: torch.Tensor | None = None, *, pass_index: int) -> torch.Tensor:
        """Final normed hidden states ``(rows, len(columns), hidden)`` of the deferred pass
        ``pass_index`` at its query ``columns`` for its batch ``rows`` (None: all)."""
        if self._saved is None or pass_index != self.passes:
            raise RuntimeError(f"read of deferred pass {pass_index}, but the last deferred pass is {self.passes}: "
                               "states can only be read until the next forward pass")
        hidden, normed, keys, values, cos, sin, mask = self._saved
        if rows is not None:
            hidden, normed, keys, values = hidden[rows], normed[rows], keys[rows], values[rows]
            mask = mask[rows] if mask.shape[0] > 1 else mask
            cos, sin = (cos[rows], sin[rows]) if cos.shape[0] > 1 else (cos, sin)
        attn = self.layer.self_attn
        batch, count = normed.shape[0], len(columns)
        queries = attn.q_proj(normed[:, columns]).view(batch, count, -1, attn.head_dim)
        if getattr(attn, "q_norm", None) is not None:
            queries = attn.q_norm(queries)
        queries = self._rotary(queries.transpose(1, 2), cos[:, columns], sin[:, columns])
        out, _ = self.attention(attn, queries, keys, values, mask[:, :, columns], dropout=0.0, scaling=attn.scaling)
        out = attn.o_proj(out.reshape(batch, count, -1).contiguous())
        states = hidden[:, columns] + out
        states = states + self.layer.mlp(self.layer.post_attention_layernorm(states))
        return self.final_norm(states)


def supports_deferred_last_layer(model: PreTrainedModel) -> bool:
    """Whether :func:`reading_last_layer` can wrap this model's last layer (module docstring)."""
    config = model.config
    if getattr(config, "model_type", None) not in _LLAMA_FAMILY:
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[-1] != "full_attention":
        return False
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not isinstance(getattr(decoder, "norm", None), nn.Module):
        return False
    last = layers[-1]
    if isinstance(last, LastLayerReader):
        return True
    if not all(hasattr(last, p) for p in _LAYER_PARTS) or not all(hasattr(last.self_attn, p) for p in _ATTENTION_PARTS):
        return False
    modeling = inspect.getmodule(type(last.self_attn))
    return all(callable(getattr(modeling, f, None)) for f in ("rotate_half", "eager_attention_forward"))


@contextmanager
def reading_last_layer(model: PreTrainedModel) -> Iterator[LastLayerReader | None]:
    """Swap the decoder's last layer for a :class:`LastLayerReader` while the block runs (None
    when the model is not supported); the original layer is put back on exit, even on error.
    Decodes of one model are serialised while the swap is in place."""
    if not supports_deferred_last_layer(model):
        yield None
        return
    with _LOCKS_GUARD:
        lock = _SWAP_LOCKS.setdefault(model, threading.RLock())
    with lock:
        layers = model.get_decoder().layers
        if isinstance(layers[-1], LastLayerReader):  # a nested decode: reuse the installed reader
            yield layers[-1]
            return
        original = layers[-1]
        reader = LastLayerReader(original, model.get_decoder().norm, model.config._attn_implementation)
        layers[-1] = reader
        try:
            yield reader
        finally:
            reader.deferred = False
            reader._saved = None
            layers[-1] = original
