"""Block-diffusion decoding: the KV-cached decoder against the recompute-everything reference,
the AR limit (block size 1), step accounting, no [MASK] in outputs, refusals."""

from __future__ import annotations

import pytest
import torch

from dgr2.config import ModelConfig
from dgr2.decoding.ar import ar_generate
from dgr2.decoding.block_diffusion import diffusion_generate
from dgr2.decoding.block_diffusion_reference import diffusion_generate_uncached
from dgr2.models.ar import build_ar_model
from dgr2.models.block_diffusion import BlockDiffusionLM

VOCAB, PAD, BOS, EOS, MASK = 40, 0, 2, 3, 4
PROMPTS = [[BOS, 5, 6, 7], [BOS, 9], [BOS, 11, 12, 13, 14, 15, 16, 17, 18], [BOS, 20, 21], [BOS, 30, 31, 32, 33]]


def tiny_ar(arch: str = "qwen2", seed: int = 5):
    cfg = ModelConfig(arch=arch, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_position_embeddings=128, seed=seed, tie_word_embeddings=False)
    model = build_ar_model(cfg, VOCAB, PAD, BOS, EOS).eval()
    with torch.no_grad():  # a sharp untied head: confidences spread around the threshold, as trained ones do
        model.lm_head.weight.mul_(30.0)
    return model


def run(fn, model, **overrides):
    kwargs = dict(block_size=4, max_steps_per_block=2, threshold=0.5, max_new_tokens=10, mask_id=MASK,
                  eos_id=None, pad_id=PAD, batch_size=3)
    kwargs.update(overrides)
    return fn(model, PROMPTS, **kwargs)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("threshold", [0.5, 1.0])
def test_cached_decoder_equals_uncached_reference(arch, threshold):
    model = tiny_ar(arch)
    cached = run(diffusion_generate, model, threshold=threshold)
    reference = run(diffusion_generate_uncached, model, threshold=threshold)
    assert cached.sequences == reference.sequences
    assert cached.forward_passes == reference.forward_passes
    assert cached.steps_per_block == reference.steps_per_block
    assert all(len(s) == 10 for s in cached.sequences)  # 4 + 4 + a short last block of 2
    if threshold == 1.0:  # nothing is that confident: exactly the ceil(remaining/steps) floor
        assert cached.steps_per_block == [2, 2, 2] * 5
        assert cached.forward_passes == 2 * 6  # two batches, 3 blocks x 2 steps each
    else:
        assert min(cached.steps_per_block) == 1  # the threshold committed a whole block at once somewhere


def test_cached_equals_reference_with_stops_and_row_dropping():
    model = tiny_ar()
    free = run(diffusion_generate_uncached, model, max_new_tokens=16)
    stop = free.sequences[2][5]  # a token some row commits: forces early stops mid-block
    cached = run(diffusion_generate, model, max_new_tokens=16, eos_id=EOS, stop_ids=(stop,))
    reference = run(diffusion_generate_uncached, model, max_new_tokens=16, eos_id=EOS, stop_ids=(stop,))
    assert cached.sequences == reference.sequences
    assert cached.sequence_forward_passes == reference.sequence_forward_passes
    assert any(len(s) < 16 for s in cached.sequences)
    for seq in cached.sequences:
        hits = [i for i, t in enumerate(seq) if t in (stop, EOS)]
        assert hits in ([], [len(seq) - 1])


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_block_size_one_equals_ar_greedy(arch):
    model = tiny_ar(arch)
    with torch.no_grad():  # like a trained AR model, never prefer [MASK] (the diffusion decoder excludes it)
        model.lm_head.weight[MASK].zero_()
    ar = ar_generate(model, PROMPTS, max_new_tokens=12, eos_id=EOS, pad_id=PAD, stop_ids=(7,), batch_size=3)
    diff = diffusion_generate(BlockDiffusionLM(model, mask_id=MASK, block_size=1), PROMPTS, block_size=1,
                              max_steps_per_block=1, threshold=1.0, max_new_tokens=12, mask_id=MASK,
                              eos_id=EOS, pad_id=PAD, stop_ids=(7,), batch_size=3)
    assert diff.sequences == ar.sequences
    assert diff.sequence_forward_passes == ar.sequence_forward_passes
    assert diff.tokens_per_forward == pytest.approx(1.0)


def test_mask_token_never_appears_in_outputs():
    model = tiny_ar()
    with torch.no_grad():  # make [MASK] the model's favourite prediction everywhere
        model.lm_head.weight[MASK].mul_(100.0)
    assert MASK in sum(ar_generate(model, PROMPTS, max_new_tokens=6, eos_id=None, pad_id=PAD).sequences, [])
    out = run(diffusion_generate, model, max_new_tokens=12, threshold=0.3)
    assert all(MASK not in seq for seq in out.sequences)
    assert all(len(seq) == 12 for seq in out.sequences)


def test_bad_decoding_settings_are_refused():
    model = tiny_ar().train()
    with pytest.raises(ValueError, match="max_steps_per_block must be in 1..block_size"):
        run(diffusion_generate, model, block_size=4, max_steps_per_block=5)
    with pytest.raises(ValueError, match="block_size must be an int"):
        run(diffusion_generate, model, block_size=0, max_steps_per_block=1)
    with pytest.raises(ValueError, match="threshold must be in"):
        run(diffusion_generate, model, threshold=0.0)
    with pytest.raises(ValueError, match="cannot also be a stop token"):
        run(diffusion_generate, model, eos_id=MASK)
    run(diffusion_generate, model, max_new_tokens=4)
    assert model.training  # decoding borrowed the model and gave it back in train mode


def test_sampled_decoding_is_seeded_and_records_its_trajectory():
    """Rollouts sample (temperature > 0): same seed, same trajectory in the cached and the
    reference decoder; every kept token records the step that committed it and its log-prob."""
    model = tiny_ar()
    kwargs = dict(max_new_tokens=12, temperature=1.0, seed=7, max_steps_per_block=3)
    a = run(diffusion_generate, model, **kwargs)
    b = run(diffusion_generate_uncached, model, **kwargs)
    c = run(diffusion_generate, model, **{**kwargs, "seed": 8})
    assert a.sequences == b.sequences and a.unmask_steps == b.unmask_steps
    assert a.sequences != c.sequences  # the seed matters: sampling, not argmax
    greedy = run(diffusion_generate, model, max_new_tokens=12, max_steps_per_block=3)
    assert greedy.sequences != a.sequences
    for seq, steps, logps in zip(a.sequences, a.unmask_steps, a.token_logprobs):
        assert len(seq) == len(steps) == len(logps) == 12
        assert all(0 <= s < 3 for s in steps) and all(lp <= 0.0 for lp in logps)
        for block in range(0, 12, 4):  # each step of a block commits at least one token
            block_steps = steps[block : block + 4]
            assert set(block_steps) == set(range(max(block_steps) + 1))
    with pytest.raises(ValueError, match="temperature"):
        run(diffusion_generate, model, temperature=-1.0)


def test_left_to_right_commit_takes_the_confident_run_from_the_leftmost_masked_slot():
    from dgr2.decoding.commit import commit_step

    # one row, 6 slots, slot 0 already committed; per-slot confidence of the argmax token
    confidence = torch.tensor([[0.99, 0.95, 0.97, 0.60, 0.99, 0.99]])
    logits = torch.log(torch.stack([confidence, 1 - confidence], -1)).nan_to_num(neginf=-30.0)
    logits = torch.cat([logits, torch.full((1, 6, 1), -30.0)], -1)  # token 2 = [MASK], never proposed
    masked = torch.tensor([[False, True, True, True, True, True]])
    l2r, tokens, _ = commit_step(logits, masked, 0.9, steps_left=5, mask_id=2, order="left_to_right")
    paper, _, _ = commit_step(logits, masked, 0.9, steps_left=5, mask_id=2, order="confidence")
    assert l2r.tolist() == [[False, True, True, False, False, False]]  # stops at the unsure slot 3
    assert paper.tolist() == [[False, True, True, False, True, True]]  # confident slots anywhere
    assert (tokens == 0).all()
    # nothing confident: the leftmost masked slot (AR order), not the most confident one
    unsure, _, _ = commit_step(logits, masked, 0.999, steps_left=5, mask_id=2, order="left_to_right")
    assert unsure.tolist() == [[False, True, False, False, False, False]]
    # the step floor still holds: 5 masked slots, 2 steps left -> at least the 3 leftmost
    floor, _, _ = commit_step(logits, masked, 0.999, steps_left=2, mask_id=2, order="left_to_right")
    assert floor.tolist() == [[False, True, True, True, False, False]]
    with pytest.raises(ValueError, match="unknown commit order"):
        commit_step(logits, masked, 0.9, steps_left=5, mask_id=2, order="random")


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
def test_threshold_one_commits_one_slot_even_when_float32_rounds_to_certainty(order):
    from dgr2.decoding.commit import commit_step

    logits = torch.tensor([[[0.0, -40.0, -40.0]] * 4])  # p(token 0) = 1 - 8e-18: exactly 1.0 in fp32
    masked = torch.ones((1, 4), dtype=torch.bool)
    commit, _, logp = commit_step(logits, masked, 1.0, steps_left=4, mask_id=2, order=order)
    assert bool((logp.exp() == 1.0).all())  # the rounding the rule must not trust
    assert commit.sum().item() == 1
    below, _, _ = commit_step(logits, masked, 0.999, steps_left=4, mask_id=2, order=order)
    assert below.sum().item() == 4


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_left_to_right_at_threshold_one_is_greedy_ar_decoding(arch):
    """With tau = 1 the left-to-right rule commits one slot a step in reading order: the block
    model then decodes like AR greedy on the same weights whenever the block's own noisy slots
    do not change the prediction, which holds exactly for block size 1 and, for a larger
    block, is what the cached decoder must reproduce against its reference."""
    model = tiny_ar(arch)
    with torch.no_grad():
        model.lm_head.weight[MASK].zero_()
    cached = run(diffusion_generate, model, threshold=1.0, max_steps_per_block=4, commit_order="left_to_right")
    reference = run(diffusion_generate_uncached, model, threshold=1.0, max_steps_per_block=4, commit_order="left_to_right")
    assert cached.sequences == reference.sequences
    for steps in cached.unmask_steps:  # slot i of every block is committed at step i
        assert steps == [i % 4 for i in range(len(steps))]
    ar = ar_generate(model, PROMPTS, max_new_tokens=10, eos_id=None, pad_id=PAD, batch_size=3)
    one = diffusion_generate(BlockDiffusionLM(model, mask_id=MASK, block_size=1), PROMPTS, block_size=1,
                             max_steps_per_block=1, threshold=1.0, max_new_tokens=10, mask_id=MASK, eos_id=None,
                             pad_id=PAD, batch_size=3, commit_order="left_to_right")
    assert one.sequences == ar.sequences


@pytest.mark.parametrize("order", ["left_to_right", "confidence"])
def test_a_proposal_repeating_its_masked_left_neighbour_waits_a_pass(order):
    from dgr2.decoding.commit import commit_step

    def logits_for(tokens):  # confident (p ~ 1 - 1e-6) proposals of the given tokens, vocab 4, [MASK] = 3
        out = torch.full((1, len(tokens), 4), -15.0)
        for i, t in enumerate(tokens):
            out[0, i, t] = 0.0
        return out

    masked = torch.ones((1, 3), dtype=torch.bool)
    plain, _, _ = commit_step(logits_for([1, 1, 2]), masked, 0.9, steps_left=3, mask_id=3, order=order)
    deferred, _, _ = commit_step(logits_for([1, 1, 2]), masked, 0.9, steps_left=3, mask_id=3, order=order,
                                 defer_repeats=True)
    assert plain.tolist() == [[True, True, True]]
    # slot 1 repeats slot 0's proposal while slot 0 is masked: it waits; left to right stops there
    assert deferred.tolist() == ([[True, False, False]] if order == "left_to_right" else [[True, False, True]])
    # once the left neighbour is committed, the same repeat is a prediction from a known prefix
    known = torch.tensor([[False, True, True]])
    after, _, _ = commit_step(logits_for([1, 1, 2]), known, 0.9, steps_left=2, mask_id=3, order=order,
                              defer_repeats=True)
    assert after.tolist() == [[False, True, True]]
    # slots that are not neighbours in the block (a subset of its columns) never defer each other
    apart, _, _ = commit_step(logits_for([1, 1, 2]), masked, 0.9, steps_left=3, mask_id=3, order=order,
                              defer_repeats=True, positions=torch.tensor([0, 2, 3]))
    assert apart.tolist() == [[True, True, True]]
    # the step floor still forces a slot: one step left, every masked slot commits
    floor, _, _ = commit_step(logits_for([1, 1, 2]), masked, 0.9, steps_left=1, mask_id=3, order=order,
                              defer_repeats=True)
    assert floor.tolist() == [[True, True, True]]


def test_deferred_repeats_match_between_cached_and_reference_decoders():
    model = tiny_ar("qwen2")
    changed = False
    for threshold in (0.3, 0.9):
        cached = run(diffusion_generate, model, threshold=threshold, max_steps_per_block=4, defer_repeats=True)
        reference = run(diffusion_generate_uncached, model, threshold=threshold, max_steps_per_block=4,
                        defer_repeats=True)
        assert cached.sequences == reference.sequences and cached.unmask_steps == reference.unmask_steps
        plain = run(diffusion_generate, model, threshold=threshold, max_steps_per_block=4)
        changed |= plain.unmask_steps != cached.unmask_steps
    assert changed  # the random model proposes adjacent repeats, so the rule did act


@pytest.mark.parametrize("block", [8, 4])
def test_evaluation_decoder_cuts_the_trained_block_smaller_keeping_the_step_floor(block):
    """``eval.decode_block_sweep``'s decoder: blocks of ``block`` slots, and the trained block's
    tokens-a-step floor (8 slots in 4 steps = 2 a step) kept, so at tau 1 a block of 4 takes 2 steps."""
    from types import SimpleNamespace

    from dgr2.config import load_config
    from dgr2.pipeline import _decoder

    cfg = load_config("tiny", ["diffusion.block_size=8", "diffusion.max_steps_per_block=4", "eval.max_new_tokens=16"])
    tokenizer = SimpleNamespace(mask_token_id=MASK, eos_token_id=EOS, pad_token_id=PAD,
                                convert_tokens_to_ids=lambda token: VOCAB - 1)
    out = _decoder(cfg, "diffusion", tiny_ar(), tokenizer, threshold=1.0, block_size=block)(PROMPTS)
    assert max(out.steps_per_block) == block // 2  # fewer only where a stop token ended the block
    assert all(len(s) <= 16 for s in out.sequences)
    full = [s for s in out.sequences if len(s) == 16]
    assert full and len(out.steps_per_block) >= len(full) * (16 // block)
    with pytest.raises(ValueError, match="exceeds the block the model was trained with"):
        _decoder(cfg, "diffusion", tiny_ar(), tokenizer, block_size=16)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
def test_head_chunks_decode_exactly_as_every_slot_at_once(arch, threshold):
    """Greedy left-to-right steps read the head a chunk at a time, past the first chunk only for
    the rows whose run is still open, and stop where every row's run ended: same commits,
    steps, log-probs and passes as the reference, which runs the model's own head on every
    slot; and fewer head rows than reading every slot (the point of it)."""
    model = tiny_ar(arch)
    kwargs = dict(block_size=8, max_steps_per_block=8, max_new_tokens=24, threshold=threshold,
                  commit_order="left_to_right", defer_repeats=True)
    reference = run(diffusion_generate_uncached, model, **kwargs)
    rows_read = {}

    def count_rows(module, args, output):
        rows_read[chunk] += args[0].shape[0] * args[0].shape[1]

    hook = model.lm_head.register_forward_hook(count_rows)
    try:
        for chunk in (0, 1, 3, 8):
            rows_read[chunk] = 0
            out = run(diffusion_generate, model, head_chunk=chunk, **kwargs)
            assert out.sequences == reference.sequences and out.unmask_steps == reference.unmask_steps
            assert out.forward_passes == reference.forward_passes
            for a, b in zip(out.token_logprobs, reference.token_logprobs):
                assert a == pytest.approx(b, abs=1e-5)
    finally:
        hook.remove()
    assert rows_read[1] <= rows_read[3] <= rows_read[0] == rows_read[8] and rows_read[1] < rows_read[0]


def test_head_chunks_keep_the_step_floor_and_sampling_whole():
    """A step floor above the chunk (8 slots in 2 steps: 4 forced a step) is still met, and
    sampled steps (rollouts) draw every slot at once, so a seed gives the same trajectory with
    or without chunks."""
    model = tiny_ar()
    floor = dict(block_size=8, max_steps_per_block=2, max_new_tokens=16, threshold=0.99, commit_order="left_to_right")
    reference = run(diffusion_generate_uncached, model, **floor)
    chunked = run(diffusion_generate, model, head_chunk=1, **floor)
    assert chunked.sequences == reference.sequences and chunked.unmask_steps == reference.unmask_steps
    assert max(chunked.steps_per_block) == 2
    sampled = dict(floor, threshold=0.5, temperature=1.0, seed=3, max_steps_per_block=8)
    assert run(diffusion_generate, model, head_chunk=2, **sampled).sequences == \
        run(diffusion_generate_uncached, model, **sampled).sequences
    with pytest.raises(ValueError, match="head_chunk must be >= 0"):
        run(diffusion_generate, model, head_chunk=-1)


def test_split_head_only_for_heads_it_can_reproduce():
    """The decoder reads hidden states and applies the head itself only where the model's
    logits are exactly that (no logit scale or soft-capping), else it takes the model's logits."""
    from types import SimpleNamespace

    from dgr2.decoding.runtime import split_head

    model = tiny_ar("llama")
    decoder, head = split_head(model)
    assert decoder is model.model and head is model.lm_head
    capped = SimpleNamespace(config=SimpleNamespace(model_type="gemma2"))
    assert split_head(capped) is None


def test_strict_sections_decode_alike_in_every_decoder_and_only_delay_commits():
    """From a marker token on a slot commits in parallel only at the strict bar: the chunked,
    whole-step and recompute-everything decoders decide alike; at bar 1 every slot after a row's
    first marker gets a pass of its own; a bar equal to tau changes nothing; bad settings are
    refused with the reason."""
    model = tiny_ar("qwen2")
    base = dict(block_size=8, max_steps_per_block=8, max_new_tokens=24, threshold=0.3, commit_order="left_to_right",
                defer_repeats=True)
    plain = run(diffusion_generate, model, **base)
    # the marker: the token the random model commits most often, so most rows meet it early
    counts: dict[int, int] = {}
    for seq in plain.sequences:
        for t in seq:
            counts[t] = counts.get(t, 0) + 1
    marker = max(counts, key=counts.get)
    assert run(diffusion_generate, model, strict_threshold=0.3, strict_after=[marker], **base).sequences == plain.sequences
    strict = dict(base, strict_threshold=1.0, strict_after=[marker])
    reference = run(diffusion_generate_uncached, model, **strict)
    for chunk in (0, 1, 3):
        out = run(diffusion_generate, model, head_chunk=chunk, **strict)
        assert out.sequences == reference.sequences and out.unmask_steps == reference.unmask_steps
    assert reference.forward_passes > plain.forward_passes
    checked = 0
    for seq, steps in zip(reference.sequences, reference.unmask_steps):
        if marker not in seq:
            continue
        first = seq.index(marker)
        for start in range(0, len(seq), 8):  # per block: the slots after the marker commit one a pass
            after = [steps[i] for i in range(max(start, first + 1), min(start + 8, len(seq)))]
            assert len(after) == len(set(after))
            checked += len(after)
    assert checked > 10
    with pytest.raises(ValueError, match="strict_threshold must be in"):
        run(diffusion_generate, model, **dict(base, strict_threshold=0.2, strict_after=[marker]))
    with pytest.raises(ValueError, match="go together"):
        run(diffusion_generate, model, **dict(base, strict_threshold=0.5))
    with pytest.raises(ValueError, match="cannot be a strict-section marker"):
        run(diffusion_generate, model, **dict(base, strict_threshold=0.5, strict_after=[MASK]))
