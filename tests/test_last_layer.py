"""The deferred last layer (dgr2.decoding.last_layer): the states it computes at chosen columns
equal the full layer's, decoders give the same tokens with and without it, it is actually used,
and the model is left as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

import dgr2.decoding.last_layer as last_layer
from dgr2.config import ModelConfig
from dgr2.decoding.ar import ar_generate
from dgr2.decoding.block_diffusion import diffusion_generate
from dgr2.decoding.kv_cache import decoding_cache
from dgr2.decoding.last_layer import LastLayerReader, reading_last_layer, supports_deferred_last_layer
from dgr2.models.ar import build_ar_model

VOCAB, PAD, BOS, EOS, MASK = 40, 0, 2, 3, 4
PROMPTS = [[BOS, 5, 6, 7], [BOS, 9], [BOS, 11, 12, 13, 14, 15, 16, 17, 18], [BOS, 20, 21], [BOS, 30, 31, 32, 33]]


def tiny(arch: str = "qwen2", attn: str = "sdpa", seed: int = 5):
    if arch == "qwen3":  # q_norm / k_norm in attention; not a ModelConfig arch, built directly
        torch.manual_seed(seed)
        config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128,
                             tie_word_embeddings=False, attn_implementation=attn)
        model = Qwen3ForCausalLM(config).eval()
    else:
        cfg = ModelConfig(arch=arch, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                          max_position_embeddings=128, seed=seed, tie_word_embeddings=False)
        model = build_ar_model(cfg, VOCAB, PAD, BOS, EOS).eval()
        model.config._attn_implementation = attn
    with torch.no_grad():  # a sharp head: commit runs of different lengths, rows finishing blocks apart
        model.lm_head.weight.mul_(30.0)
    return model


def random_mask(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand((batch, 1, length, length), generator=generator) > 0.3
    allowed[..., torch.arange(length), torch.arange(length)] = True
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("arch,attn", [("qwen2", "sdpa"), ("llama", "sdpa"), ("qwen3", "sdpa"), ("qwen2", "eager")])
@pytest.mark.parametrize("masked", [True, False])
def test_deferred_states_equal_the_full_layer(arch, attn, masked):
    model = tiny(arch, attn)
    decoder = model.get_decoder()
    ids = torch.randint(5, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).expand(3, 12)
    mask = random_mask(3, 12) if masked else None
    with torch.inference_mode():
        full = decoder(input_ids=ids, position_ids=pos, attention_mask=mask).last_hidden_state
        with reading_last_layer(model) as reader:
            assert reader is not None
            reader.deferred = True
            out = decoder(input_ids=ids, position_ids=pos, attention_mask=mask, cache=decoding_cache(model, 16),
                          use_cache=True).last_hidden_state
            cols, rows = torch.tensor([0, 4, 5, 11]), torch.tensor([2, 0])
            every_row = reader.read(cols, pass_index=reader.passes)
            some_rows = reader.read(cols, rows, pass_index=reader.passes)
    assert out.shape == (3, 0, 32)  # nothing past the keys and values ran
    torch.testing.assert_close(every_row, full[:, cols], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(some_rows, full[rows][:, cols], rtol=1e-5, atol=1e-5)


def test_a_read_after_the_next_pass_is_refused():
    model = tiny()
    decoder = model.get_decoder()
    ids = torch.tensor([[BOS, 5, 6]])
    with torch.inference_mode(), reading_last_layer(model) as reader:
        reader.deferred = True
        decoder(input_ids=ids, use_cache=False)
        first = reader.passes
        decoder(input_ids=ids, use_cache=False)
        with pytest.raises(RuntimeError, match="until the next forward pass"):
            reader.read(torch.tensor([0]), pass_index=first)


def count_reads(monkeypatch) -> list[int]:
    """Spy on the reader's reads; the tiny passes here are below the size where decoders defer,
    so the floor is lowered to make every pass deferred."""
    monkeypatch.setattr(last_layer, "MIN_DEFERRED_QUERIES", 0)
    calls: list[int] = []
    original = LastLayerReader.read

    def spy(self, columns, rows=None, *, pass_index):
        calls.append(len(columns))
        return original(self, columns, rows, pass_index=pass_index)

    monkeypatch.setattr(LastLayerReader, "read", spy)
    return calls


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("kwargs", [
    dict(threshold=0.5, commit_order="confidence", head_chunk=0),
    dict(threshold=0.5, commit_order="left_to_right", head_chunk=2, defer_repeats=True),
    dict(threshold=0.3, commit_order="left_to_right", head_chunk=0, temperature=0.8, seed=3),
])
def test_block_decoder_tokens_unchanged_and_last_layer_deferred(monkeypatch, arch, kwargs):
    model = tiny(arch)
    common = dict(block_size=8, max_steps_per_block=8, max_new_tokens=20, mask_id=MASK, eos_id=EOS, pad_id=PAD,
                  batch_size=3, **kwargs)
    whole = diffusion_generate(model, PROMPTS, defer_last_layer=False, **common)
    reads = count_reads(monkeypatch)
    deferred = diffusion_generate(model, PROMPTS, **common)
    assert deferred.sequences == whole.sequences
    assert deferred.unmask_steps == whole.unmask_steps
    assert deferred.forward_passes == whole.forward_passes
    for a, b in zip(deferred.token_logprobs, whole.token_logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    assert reads, "the block decoder never read through the deferred last layer"
    # the point of it: fewer last-layer rows than slots predicted (8-slot blocks, 1-2 read a step on average)
    assert sum(reads) < sum(len(s) for s in whole.sequences) * 8


def test_ar_prefill_reads_one_token_and_tokens_are_unchanged(monkeypatch):
    model = tiny()
    whole = ar_generate(model, PROMPTS, max_new_tokens=12, eos_id=EOS, pad_id=PAD, batch_size=3, defer_last_layer=False)
    reads = count_reads(monkeypatch)
    deferred = ar_generate(model, PROMPTS, max_new_tokens=12, eos_id=EOS, pad_id=PAD, batch_size=3)
    assert deferred.sequences == whole.sequences
    assert deferred.forward_passes == whole.forward_passes
    assert reads == [1, 1]  # one prefill per batch of 3, the last prompt token only


def test_model_is_put_back_even_when_decoding_fails():
    model = tiny()
    keys = list(model.state_dict())
    layer = model.get_decoder().layers[-1]
    with pytest.raises(ZeroDivisionError):
        with reading_last_layer(model) as reader:
            assert model.get_decoder().layers[-1] is reader and reader.layer is layer
            raise ZeroDivisionError
    assert model.get_decoder().layers[-1] is layer
    assert list(model.state_dict()) == keys
    diffusion_generate(model, PROMPTS, block_size=4, max_steps_per_block=4, threshold=0.5, max_new_tokens=8,
                       mask_id=MASK, eos_id=None, pad_id=PAD, batch_size=2)
    assert model.get_decoder().layers[-1] is layer


def test_unsupported_models_run_the_whole_layer():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64))
    assert not supports_deferred_last_layer(gpt2)
    with reading_last_layer(gpt2) as reader:
        assert reader is None
    assert supports_deferred_last_layer(tiny())


def test_small_passes_run_the_whole_layer():
    model = tiny()
    decoder = model.get_decoder()
    with reading_last_layer(model) as reader:
        diffusion_generate(model, PROMPTS, block_size=4, max_steps_per_block=4, threshold=0.5, max_new_tokens=8,
                           mask_id=MASK, eos_id=None, pad_id=PAD, batch_size=2)
        ar_generate(model, PROMPTS, max_new_tokens=4, eos_id=None, pad_id=PAD, batch_size=2)
        assert reader.passes == 0  # every pass had fewer than MIN_DEFERRED_QUERIES query tokens
        assert decoder.layers[-1] is reader  # the nested decodes reused the installed reader
