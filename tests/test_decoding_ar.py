"""Batched, cached, left-padded AR decoding must equal the naive one-prompt-at-a-time loop."""

from __future__ import annotations

import pytest
import torch

from dgr2.config import ModelConfig
from dgr2.decoding.ar import ar_generate
from dgr2.models.ar import build_ar_model

VOCAB, PAD, BOS, EOS = 40, 0, 2, 3


def tiny_model(arch: str = "qwen2"):
    cfg = ModelConfig(arch=arch, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_position_embeddings=128, seed=1)
    return build_ar_model(cfg, VOCAB, PAD, BOS, EOS).eval()


def reference_greedy(model, prompt: list[int], max_new: int, stops: set[int]) -> list[int]:
    """Recompute the full sequence every step, no cache, no padding."""
    seq, new = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            seq.append(token)
            new.append(token)
            if token in stops:
                break
    return new


PROMPTS = [[BOS, 5, 6, 7], [BOS, 9], [BOS, 11, 12, 13, 14, 15, 16, 17, 18], [BOS, 20, 21], [BOS, 30, 31, 32, 33]]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_batched_cached_equals_uncached_reference(arch):
    model = tiny_model(arch)
    expected = [reference_greedy(model, p, 12, set()) for p in PROMPTS]
    out = ar_generate(model, PROMPTS, max_new_tokens=12, eos_id=None, pad_id=PAD, batch_size=3)
    assert out.sequences == expected
    assert out.tokens_generated == 12 * len(PROMPTS)
    # two batches (3 + 2 prompts), 12 calls each: prefill gives token 1, then one call per token
    assert out.forward_passes == 24
    assert out.sequence_forward_passes == [12] * len(PROMPTS)


def test_rows_stop_independently_at_stop_tokens():
    model = tiny_model()
    free = [reference_greedy(model, p, 12, set()) for p in PROMPTS]
    stop = free[0][3]  # a token prompt 0 emits at step 4: guarantees at least one early stop
    expected = [reference_greedy(model, p, 12, {stop, EOS}) for p in PROMPTS]
    assert any(len(e) < 12 for e in expected)
    out = ar_generate(model, PROMPTS, max_new_tokens=12, eos_id=EOS, pad_id=PAD, stop_ids=(stop,), batch_size=8)
    assert out.sequences == expected
    assert out.sequence_forward_passes == [len(e) for e in expected]
    assert out.forward_passes == max(len(e) for e in expected)
    for seq in out.sequences:
        stops_in = [i for i, t in enumerate(seq) if t in (stop, EOS)]
        assert stops_in in ([], [len(seq) - 1])  # cut right after the first stop, inclusive


def test_model_training_flag_is_restored_and_bad_inputs_refused():
    model = tiny_model().train()
    ar_generate(model, PROMPTS[:1], max_new_tokens=2, eos_id=None, pad_id=PAD)
    assert model.training
    with pytest.raises(ValueError, match="empty prompt"):
        ar_generate(model, [[BOS], []], max_new_tokens=2, eos_id=None, pad_id=PAD)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ar_generate(model, [[BOS]], max_new_tokens=0, eos_id=None, pad_id=PAD)
