"""The decoders' in-place KV cache: same keys/values as transformers' DynamicCache through
appends, crops, row selection and growth; rows views keep nothing; block decoding that skips
the rows done with their block decodes exactly what the recompute-everything reference does."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen2Config

from dgr2.decoding.block_diffusion import diffusion_generate
from dgr2.decoding.block_diffusion_reference import diffusion_generate_uncached
from dgr2.decoding.kv_cache import KVCache, decoding_cache
from tests.test_decoding_block_diffusion import MASK, PAD, PROMPTS, tiny_ar


def kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 4, generator=g)


def test_appends_crops_selects_and_growth_match_dynamic_cache():
    ours, theirs = KVCache(num_layers=2, capacity=5), DynamicCache()
    seed, batch = 0, 3
    for op in ["append 4", "append 3", "crop 2", "append 1", "select", "append 6", "crop 6", "append 2"]:
        if op.startswith("append"):
            n = int(op.split()[1])
            for layer in range(2):
                seed += 1
                k, v = kv(batch, n, seed)
                got, want = ours.update(k, v, layer), theirs.update(k, v, layer)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        elif op.startswith("crop"):
            ours.crop(-int(op.split()[1]))
            theirs.crop(-int(op.split()[1]))
        else:
            rows, batch = torch.tensor([2, 0]), 2
            ours.batch_select_indices(rows)
            theirs.batch_select_indices(rows)
        assert ours.get_seq_length() == theirs.get_seq_length()
        for a, b in zip(ours.layers, theirs.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert ours.layers[0].key_buffer.shape[2] >= 10  # grew past its first capacity of 5


def test_a_rows_view_reads_those_rows_and_keeps_nothing():
    cache = KVCache(num_layers=1, capacity=16)
    cache.update(*kv(3, 6, 1), 0)
    before = cache.layers[0].keys.clone()
    new_k, new_v = kv(2, 4, 2)
    keys, values = cache.rows_view(torch.tensor([2, 1])).update(new_k, new_v, 0)
    assert torch.equal(keys, torch.cat([before[[2, 1]], new_k], dim=2))
    assert values.shape == (2, 2, 10, 4)
    assert cache.get_seq_length() == 6 and torch.equal(cache.layers[0].keys, before)


def test_bad_crops_and_an_empty_rows_view_are_refused():
    cache = KVCache(num_layers=1)
    with pytest.raises(RuntimeError, match="filled cache"):
        cache.rows_view(torch.tensor([0]))
    cache.update(*kv(1, 3, 0), 0)
    with pytest.raises(ValueError, match="negative"):
        cache.crop(2)
    with pytest.raises(ValueError, match="cannot crop 5"):
        cache.crop(-5)


def test_sliding_window_models_keep_their_own_cache():
    full = Qwen2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       intermediate_size=32, vocab_size=10)
    sliding = Qwen2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                          intermediate_size=32, vocab_size=10, use_sliding_window=True, sliding_window=4,
                          max_window_layers=0)

    class Stub:
        def __init__(self, config):
            self.config = config

    assert isinstance(decoding_cache(Stub(full)), KVCache)
    assert not isinstance(decoding_cache(Stub(sliding)), KVCache)


@pytest.mark.parametrize("settings", [
    dict(threshold=0.5, commit_order="confidence"),
    dict(threshold=0.6, commit_order="left_to_right", defer_repeats=True, head_chunk=2),
    dict(threshold=0.5, commit_order="left_to_right", temperature=1.0, seed=4),
])
def test_skipping_rows_done_with_their_block_changes_no_output(settings):
    """Rows whose block is complete while others are still open are left out of the pass (the
    forward then sees fewer rows than the batch); sequences, steps and log-probs stay the
    reference's, greedy and sampled."""
    model = tiny_ar()
    batch_rows: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: batch_rows.append(args[0].shape[0]))
    kwargs = dict(block_size=8, max_steps_per_block=8, max_new_tokens=24, mask_id=MASK, eos_id=None, pad_id=PAD,
                  batch_size=5, **settings)
    try:
        cached = diffusion_generate(model, PROMPTS, **kwargs)
    finally:
        hook.remove()
    kwargs.pop("head_chunk", None)  # the reference runs the model's own head on every slot
    reference = diffusion_generate_uncached(model, PROMPTS, **kwargs)
    assert cached.sequences == reference.sequences and cached.unmask_steps == reference.unmask_steps
    assert cached.forward_passes == reference.forward_passes
    for a, b in zip(cached.token_logprobs, reference.token_logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    assert min(batch_rows) < len(PROMPTS)  # some pass ran on the open rows only
