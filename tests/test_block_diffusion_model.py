"""The block-diffusion view of an AR model: attention rule, exact conversion, loss, refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from dgr2.config import DiffusionConfig, ModelConfig
from dgr2.models.ar import build_ar_model
from dgr2.models.block_diffusion import BlockDiffusionLM, DiffusionBatch
from dgr2.models.block_mask import allowed_attention, render
from dgr2.models.mask_schedule import mask_ratio, sample_block_masks

VOCAB, PAD, BOS, EOS, MASK = 40, 0, 2, 3, 4


def tiny_ar(arch: str = "qwen2", attn: str | None = None):
    cfg = ModelConfig(arch=arch, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_position_embeddings=128, seed=3)
    model = build_ar_model(cfg, VOCAB, PAD, BOS, EOS).eval()
    if attn is not None:
        model.set_attn_implementation(attn)
    return model


def sample_batch() -> DiffusionBatch:
    prompts = [[BOS, 5, 6, 7, 8], [BOS, 9, 10], [BOS, 11, 12, 13]]
    completions = [[20, 21, 22, 23, 24, 25, 26], [27, 28, 29], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
    return DiffusionBatch.collate(prompts, completions, PAD)


def test_attention_rule_on_a_small_layout():
    # one left pad + 2 prompt tokens; completion of 3 tokens + 1 right pad; blocks of 2
    batch = DiffusionBatch.collate([[BOS, 5], [BOS, 5, 6]], [[7, 8, 9], [7, 8, 9, 10]], PAD)
    model = BlockDiffusionLM(tiny_ar(), mask_id=MASK, block_size=2)
    layout = model.training_layout(batch, batch.completion_ids)
    allowed = allowed_attention(layout.tokens, layout.tokens)[0]
    # columns: pad P0 P1 | C0 C1 C2 pad | N0 N1 N2 pad   (C*, N* blocks: 0 0 1)
    assert render(allowed) == [
        "1..........",  # pad query: only itself
        ".1.........",  # prompt: causal
        ".11........",
        ".1111......",  # clean block 0: prompt + its own block, both ways
        ".1111......",
        ".11111.....",  # clean block 1: prompt + clean blocks 0..1
        "......1....",
        ".11....11..",  # noisy block 0: prompt + itself (no clean completion yet)
        ".11....11..",
        ".1111....1.",  # noisy block 1: prompt + clean block 0 + itself
        "..........1",
    ]
    # noisy tokens reuse the clean positions (pads keep counting, they are never seen);
    # the first token of a block reads the clean stream
    assert layout.position_ids[0].tolist() == [0, 0, 1, 2, 3, 4, 5, 2, 3, 4, 5]
    assert layout.logit_columns.tolist() == [2, 7, 4, 9]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_block_size_one_reproduces_ar_logits_exactly(arch):
    ar = tiny_ar(arch)
    model = BlockDiffusionLM(ar, mask_id=MASK, block_size=1)
    batch = sample_batch()
    noisy = torch.where(torch.rand(batch.completion_ids.shape) < 0.5, MASK, batch.completion_ids)
    with torch.no_grad():
        logits = model.shifted_logits(batch, noisy)
        for i in range(batch.prompt_ids.shape[0]):
            prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
            completion = batch.completion_ids[i][batch.completion_mask[i].bool()]
            ar_logits = ar(torch.cat([prompt, completion])[None]).logits[0]
            expected = ar_logits[len(prompt) - 1 : len(prompt) + len(completion) - 1]
            torch.testing.assert_close(logits[i, : len(completion)], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_honours_the_block_mask(attn):
    """Block b's predictions change with its own noisy tokens only, never with later blocks."""
    model = BlockDiffusionLM(tiny_ar(attn=attn), mask_id=MASK, block_size=3)
    batch = DiffusionBatch.collate([[BOS, 5, 6]], [[10, 11, 12, 13, 14, 15, 16, 17, 18]], PAD)
    noisy = batch.completion_ids.clone()
    noisy[0, [1, 4, 7]] = MASK
    with torch.no_grad():
        base = model.shifted_logits(batch, noisy)
        later = DiffusionBatch.collate([[BOS, 5, 6]], [[10, 11, 12, 13, 14, 15, 30, 31, 32]], PAD)
        changed_future = model.shifted_logits(later, noisy)  # clean block 2 differs
        other_noisy = noisy.clone()
        other_noisy[0, 6:] = MASK  # noisy block 2 differs
        changed_other = model.shifted_logits(batch, other_noisy)
        own = noisy.clone()
        own[0, 5] = MASK  # last token of noisy block 1: seen bidirectionally by block 1
        changed_own = model.shifted_logits(batch, own)
    torch.testing.assert_close(changed_future[0, :6], base[0, :6])
    torch.testing.assert_close(changed_other[0, :6], base[0, :6])
    assert not torch.allclose(changed_own[0, 4:6], base[0, 4:6])
    torch.testing.assert_close(changed_own[0, :4], base[0, :4])
    torch.testing.assert_close(changed_own[0, 6:], base[0, 6:])


def test_loss_is_on_masked_supervised_tokens_only():
    model = BlockDiffusionLM(tiny_ar(), mask_id=MASK, block_size=4, loss_weighting="none")
    prompts, completions = [[BOS, 5, 6], [BOS, 7]], [[10, 11, 12, 13, 14, 15], [16, 17, 18]]
    loss_masks = [[False, False, True, True, True, True], [True, True, True]]
    batch = DiffusionBatch.collate(prompts, completions, PAD, loss_masks)
    masked, ratio = sample_block_masks(batch.loss_mask, 4, "uniform", 1e-3, torch.Generator().manual_seed(0))
    assert not bool((masked & ~batch.loss_mask).any())
    for row in range(2):  # every block with supervision has at least one masked token
        for start in range(0, 6, 4):
            if batch.loss_mask[row, start : start + 4].any():
                assert masked[row, start : start + 4].any()
    out = model.loss_from_masks(batch, masked, ratio)
    noisy = torch.where(masked, MASK, batch.completion_ids)
    with torch.no_grad():
        ce = F.cross_entropy(model.shifted_logits(batch, noisy).transpose(1, 2), batch.completion_ids, reduction="none")
    torch.testing.assert_close(out.loss.detach(), ce[masked].mean())
    model.loss_weighting = "inverse_t"
    weighted = model.loss_from_masks(batch, masked, ratio).loss.detach()
    torch.testing.assert_close(weighted, (ce[masked] / ratio[masked]).sum() / batch.loss_mask.sum())
    # gradients flow, through the shared AR weights
    model.diffusion_loss(batch, generator=torch.Generator().manual_seed(1)).loss.backward()
    assert model.ar.get_input_embeddings().weight.grad is not None


@pytest.mark.parametrize("weighting", ["inverse_t", "none"])
def test_token_weights_weigh_the_loss_and_all_ones_change_nothing(weighting):
    """``token_weights`` (the CFT ranking-section weight): all ones give the unweighted loss
    exactly; other weights give the weighted mean written out by hand, with sums of weights as
    the denominators; bad weights are refused."""
    model = BlockDiffusionLM(tiny_ar(), mask_id=MASK, block_size=4, loss_weighting=weighting)
    prompts, completions = [[BOS, 5, 6], [BOS, 7]], [[10, 11, 12, 13, 14, 15], [16, 17, 18]]
    batch = DiffusionBatch.collate(prompts, completions, PAD)
    masked, ratio = sample_block_masks(batch.loss_mask, 4, "uniform", 1e-3, torch.Generator().manual_seed(3))
    plain = model.loss_from_masks(batch, masked, ratio).loss.detach()
    ones = torch.ones(masked.shape)
    assert torch.equal(model.loss_from_masks(batch, masked, ratio, ones).loss.detach(), plain)
    weights = torch.ones(masked.shape)
    weights[:, 3:] = 4.0  # a "ranking section" from slot 3 on
    out = model.loss_from_masks(batch, masked, ratio, weights).loss.detach()
    noisy = torch.where(masked, MASK, batch.completion_ids)
    with torch.no_grad():
        ce = F.cross_entropy(model.shifted_logits(batch, noisy).transpose(1, 2), batch.completion_ids, reduction="none")
    sup = batch.loss_mask
    if weighting == "inverse_t":
        expected = (weights * ce * masked / ratio).sum() / weights[sup].sum()
    else:
        expected = (weights * ce * masked).sum() / weights[masked].sum()
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, plain)
    with pytest.raises(ValueError, match="shape"):
        model.loss_from_masks(batch, masked, ratio, torch.ones((2, 3)))
    with pytest.raises(ValueError, match="positive"):
        model.loss_from_masks(batch, masked, ratio, torch.zeros(masked.shape))


def test_the_cft_loss_weighs_the_tokens_from_the_focus_token_on():
    """``cft.focus_weight``: the registered CFT loss weighs every token from the first focus
    token of its row on (the ``order`` section and answer), with the same masks as unweighted."""
    from dgr2.train.focus import focus_weights
    from dgr2.train.losses import get_loss

    ar = tiny_ar()
    focus = 13
    ids = torch.tensor([[BOS, 5, 6, 10, 11, 12, 13, 14, 15, EOS], [BOS, 7, 16, 13, 17, 18, EOS, PAD, PAD, PAD]])
    rows = {"input_ids": ids, "attention_mask": (ids != PAD).long(), "prompt_len": torch.tensor([3, 2])}
    extra = {"mask_id": MASK, "pad_id": PAD, "diffusion": DiffusionConfig(block_size=4, max_steps_per_block=2).model_dump()}
    cft = get_loss("cft")

    def run(**more):
        torch.manual_seed(11)  # the loss draws its masks from the global generator
        return cft(ar, rows, {**extra, **more})[0].detach()

    plain, weighted = run(), run(focus_token_id=focus, focus_weight=4.0)
    assert torch.equal(run(focus_token_id=focus, focus_weight=1.0), plain)
    from dgr2.train.losses import diffusion_batch_from_rows

    batch = diffusion_batch_from_rows(rows, PAD)
    model = BlockDiffusionLM(ar, mask_id=MASK, block_size=4)
    torch.manual_seed(11)
    expected = model.diffusion_loss(batch, token_weights=focus_weights(batch.completion_ids, focus, 4.0)).loss.detach()
    torch.testing.assert_close(weighted, expected)
    assert not torch.allclose(weighted, plain)


def test_head_at_masked_slots_only_gives_the_full_logits_loss_and_gradients():
    """The loss runs the LM head at the masked slots only; loss and every parameter's gradient
    equal the formulation over the full (batch, Lc, vocab) logits."""
    model = BlockDiffusionLM(tiny_ar(), mask_id=MASK, block_size=4, loss_weighting="inverse_t")
    prompts, completions = [[BOS, 5, 6], [BOS, 7]], [[10, 11, 12, 13, 14, 15], [16, 17, 18]]
    batch = DiffusionBatch.collate(prompts, completions, PAD)
    masked, ratio = sample_block_masks(batch.loss_mask, 4, "uniform", 1e-3, torch.Generator().manual_seed(3))
    assert 0 < int(masked.sum()) < int(batch.loss_mask.sum())  # some slots unmasked: the head skips them
    loss = model.loss_from_masks(batch, masked, ratio).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.ar.named_parameters()}
    model.ar.zero_grad()
    noisy = torch.where(masked, MASK, batch.completion_ids)
    ce = F.cross_entropy(model.shifted_logits(batch, noisy).transpose(1, 2), batch.completion_ids, reduction="none")
    reference = (ce * masked / ratio).sum() / batch.loss_mask.sum()
    reference.backward()
    torch.testing.assert_close(loss.detach(), reference.detach())
    for name, p in model.ar.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_suffix_blocks_mask_the_last_supervised_tokens():
    supervised = torch.ones((64, 8), dtype=torch.bool)
    supervised[:, 7] = False  # a padded slot: never masked, never counted in the suffix
    masked, ratio = sample_block_masks(supervised, 4, "uniform", 1e-3, torch.Generator().manual_seed(0), suffix_prob=1.0)
    for row in masked.view(64, 2, 4).tolist():
        for b, block in enumerate(row):
            n = 4 if b == 0 else 3
            k = sum(block)
            assert 1 <= k <= n and block[:n] == [False] * (n - k) + [True] * k  # a suffix of the supervised slots
    mixed, _ = sample_block_masks(supervised, 4, "uniform", 1e-3, torch.Generator().manual_seed(0), suffix_prob=0.5)
    suffix_like = [block[: block.index(True)] == [False] * block.index(True) and all(block[block.index(True):4 - (b == 1)])
                   for row in mixed.view(64, 2, 4).tolist() for b, block in enumerate(row)]
    assert 0.5 < sum(suffix_like) / len(suffix_like) < 1.0  # random subsets are sometimes suffixes too
    with pytest.raises(ValueError, match="suffix_prob"):
        sample_block_masks(supervised, 4, "uniform", 1e-3, suffix_prob=1.5)


@pytest.mark.parametrize("schedule", ["uniform", "linear", "cosine"])
def test_mask_ratio_schedules_stay_in_range(schedule):
    u = torch.linspace(0, 1, 101)
    t = mask_ratio(u, schedule, 0.01)
    assert float(t.min()) >= 0.01 - 1e-6 and float(t.max()) <= 1.0 + 1e-6


def test_bad_configs_are_refused():
    ar = tiny_ar()
    for size in (0, -1, 65):
        with pytest.raises(ValueError, match="block_size must be an int in 1..64"):
            BlockDiffusionLM(ar, mask_id=MASK, block_size=size)
    with pytest.raises(ValueError, match="mask_id 99 outside"):
        BlockDiffusionLM(ar, mask_id=99)
    with pytest.raises(ValueError, match="unknown mask schedule"):
        BlockDiffusionLM(ar, mask_id=MASK, mask_schedule="exp")
    with pytest.raises(ValidationError, match="max_steps_per_block"):
        DiffusionConfig(block_size=4, max_steps_per_block=8)
    with pytest.raises(ValidationError):
        DiffusionConfig(block_size=0)
    with pytest.raises(ValueError, match="left padded"):
        DiffusionBatch(torch.tensor([[2, 0]]), torch.tensor([[1, 0]]), torch.tensor([[5]]),
                       torch.tensor([[1]]), torch.tensor([[True]]))
    ar.config._attn_implementation = "flash_attention_2"  # cannot take a custom 4D mask
    with pytest.raises(ValueError, match="custom 4D block mask"):
        BlockDiffusionLM(ar, mask_id=MASK)


def test_checkpoint_round_trip(tmp_path):
    model = BlockDiffusionLM(tiny_ar(), mask_id=MASK, block_size=8, mask_schedule="cosine")
    model.save_pretrained(tmp_path)
    loaded = BlockDiffusionLM.load(tmp_path)
    assert (loaded.mask_id, loaded.block_size, loaded.mask_schedule) == (MASK, 8, "cosine")
    batch = sample_batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded.shifted_logits(batch, batch.completion_ids),
                                   model.shifted_logits(batch, batch.completion_ids))


def test_shifted_logits_at_selected_positions_match_the_full_tensor():
    """The RL replay's memory-saving path (LM head on chosen rows only) gives the same numbers."""
    torch.manual_seed(0)
    model = BlockDiffusionLM(tiny_ar(), mask_id=MASK, block_size=4)
    batch = sample_batch()
    noisy = batch.completion_ids.clone()
    noisy[:, 1::2] = MASK
    full = model.shifted_logits(batch, noisy)
    pick = torch.zeros(batch.completion_ids.shape, dtype=torch.bool)
    pick[0, [0, batch.completion_ids.shape[1] - 1]] = True
    pick[-1, 1] = True
    assert torch.allclose(model.shifted_logits(batch, noisy, positions=pick), full[pick], atol=1e-5)
