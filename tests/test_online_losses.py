"""OPD and RL objectives: divergences, exact trajectory replay, rewards, advantages."""

from __future__ import annotations

import math

import pytest
import torch

from dgr2.config import ModelConfig, load_config
from dgr2.decoding.block_diffusion import diffusion_generate
from dgr2.eval.parse import parse_completion
from dgr2.eval.reward import RewardConfig, completion_reward, ranking_reward, reward_config_of, reward_of_ranking
from dgr2.models.ar import build_ar_model
from dgr2.models.block_diffusion import BlockDiffusionLM
from dgr2.train.divergence import teacher_log_probs, token_divergence
from dgr2.train.focus import focus_token_id, focus_weights
from dgr2.train.online_losses import (
    OpdSettings,
    RlSettings,
    group_advantages,
    opd_loss,
    rl_policy_loss,
    teacher_completion_logits,
    without_mask_token,
)
from dgr2.train.replay import ReplayBatch

VOCAB, PAD, BOS, EOS, MASK = 40, 0, 2, 3, 4
PROMPTS = [[BOS, 5, 6, 7], [BOS, 9], [BOS, 11, 12, 13, 14, 15], [BOS, 20, 21]]


def tiny_ar(seed: int = 5):
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_position_embeddings=128, seed=seed, tie_word_embeddings=False)
    model = build_ar_model(cfg, VOCAB, PAD, BOS, EOS).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def rollouts(model, block_size=4, steps=3, stop=(), max_new=12, seed=3):
    out = diffusion_generate(model, PROMPTS, block_size=block_size, max_steps_per_block=steps, threshold=0.6,
                             max_new_tokens=max_new, mask_id=MASK, eos_id=None, pad_id=PAD, stop_ids=stop,
                             batch_size=2, temperature=1.0, seed=seed)
    return out, ReplayBatch.collate(PROMPTS, out.sequences, out.unmask_steps, out.tail_tokens,
                                    out.tail_unmask_steps, out.token_logprobs, PAD)


# ------------------------------------------------------------------ divergences
@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd"])
def test_divergence_is_zero_iff_distributions_match(kind):
    torch.manual_seed(0)
    a, b = torch.randn(6, 11), torch.randn(6, 11)
    assert torch.allclose(token_divergence(a, a.log_softmax(-1), kind), torch.zeros(6), atol=1e-6)
    assert bool((token_divergence(a, b.log_softmax(-1), kind) > 1e-4).all())


def test_teacher_top_k_is_a_distribution_keeping_the_top_tokens():
    torch.manual_seed(1)
    logits = torch.randn(3, 20)
    top = teacher_log_probs(logits, top_k=5)
    assert torch.allclose(top.exp().sum(-1), torch.ones(3), atol=1e-5)
    full = logits.log_softmax(-1)
    idx = full.topk(5, -1).indices
    assert torch.allclose(top.gather(-1, idx), full.gather(-1, idx))


# ------------------------------------------------------------------ replay is exact
@pytest.mark.parametrize("stop", [(), (7, 8, 9, 10, 11, 12)])
def test_replay_reproduces_the_decoder_log_probs(stop):
    """Re-scoring each recorded state with the training layout gives the log-prob the decoder
    sampled with, token by token: the RL estimator is exact given the unmasking order."""
    model = tiny_ar()
    out, replay = rollouts(model, stop=stop)
    if stop:
        assert any(len(s) < 12 for s in out.sequences)  # some rows stopped mid-block
    policy = BlockDiffusionLM(model, mask_id=MASK, block_size=4)
    supervised = replay.batch.loss_mask.bool()
    checked = 0
    with torch.no_grad():
        for k in range(3):
            sel = (replay.steps == k) & supervised
            noisy = replay.state_before(torch.full_like(replay.steps, k), MASK)
            logits = policy.shifted_logits(replay.batch, noisy).float()
            logits[..., MASK] = float("-inf")
            logp = logits.log_softmax(-1).gather(-1, replay.batch.completion_ids[..., None]).squeeze(-1)
            assert torch.allclose(logp[sel], replay.old_logprobs[sel], atol=1e-4)
            checked += int(sel.sum())
    assert checked == sum(len(s) for s in out.sequences)


def test_rl_loss_is_on_policy_at_the_first_update_and_has_gradient():
    model = tiny_ar()
    out, replay = rollouts(model)
    policy = BlockDiffusionLM(model.train(), mask_id=MASK, block_size=4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, stats = rl_policy_loss(policy, replay, adv, RlSettings(temperature=1.0))
    assert stats["mean_ratio"] == pytest.approx(1.0, abs=1e-3) and stats["clip_fraction"] == 0.0
    assert stats["policy_tokens"] == sum(len(s) for s in out.sequences)
    loss.backward()
    assert any(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters())
    zero, _ = rl_policy_loss(policy, replay, torch.zeros(4), RlSettings())
    assert float(zero) == 0.0


# ------------------------------------------------------------------ OPD
def test_opd_loss_is_zero_when_student_equals_teacher_and_positive_otherwise():
    teacher = tiny_ar(seed=5)
    # block size 1: the diffusion view of the same weights is exactly the AR model
    out, replay = rollouts(teacher, block_size=1, steps=1)
    same = BlockDiffusionLM(tiny_ar(seed=5), mask_id=MASK, block_size=1)
    for kind in ("reverse_kl", "forward_kl", "jsd"):
        loss, stats = opd_loss(same, teacher, replay, OpdSettings(divergence=kind))
        assert float(loss) == pytest.approx(0.0, abs=1e-5) and stats["teacher_agreement"] == 1.0
        other = BlockDiffusionLM(tiny_ar(seed=9), mask_id=MASK, block_size=1)
        assert float(opd_loss(other, teacher, replay, OpdSettings(divergence=kind))[0]) > 1e-3
    # a real block size: same weights still disagree inside a block (the conversion gap)
    out, replay = rollouts(teacher, block_size=4, steps=3)
    student = BlockDiffusionLM(tiny_ar(seed=5), mask_id=MASK, block_size=4)
    assert float(opd_loss(student, teacher, replay, OpdSettings())[0]) > 1e-3


def test_committed_opd_distils_exactly_the_tokens_decided_at_the_sampled_step():
    teacher = tiny_ar(seed=5)
    out, replay = rollouts(teacher, block_size=4, steps=3)
    student = BlockDiffusionLM(tiny_ar(seed=9), mask_id=MASK, block_size=4)
    k = replay.sample_step_per_block(4, torch.Generator().manual_seed(0))
    supervised = replay.batch.loss_mask.bool()
    decided = int(((replay.steps == k) & supervised).sum())
    still_masked = int(((replay.steps >= k) & supervised).sum())
    assert 0 < decided < still_masked  # some block committed several steps: the modes differ
    stats = {mode: opd_loss(student, teacher, replay, OpdSettings(student_mask=mode), torch.Generator().manual_seed(0))[1]
             for mode in ("committed", "replay")}
    assert stats["committed"]["distilled_tokens"] == decided
    assert stats["replay"]["distilled_tokens"] == still_masked
    with pytest.raises(ValueError, match="committed"):
        opd_loss(student, teacher, replay, OpdSettings(student_mask="nope"))


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
def test_opd_loss_equals_the_divergence_over_the_full_student_logits(divergence):
    """The student's head runs at the distilled slots only: loss and gradient are those of the
    full (batch, Lc, vocab) logits indexed at the same slots."""
    teacher = tiny_ar(seed=5)
    _, replay = rollouts(teacher, block_size=4, steps=3)
    student = BlockDiffusionLM(tiny_ar(seed=9), mask_id=MASK, block_size=4)
    settings = OpdSettings(student_mask="committed", divergence=divergence)
    loss, _ = opd_loss(student, teacher, replay, settings, torch.Generator().manual_seed(0))
    loss.backward()
    grad = student.ar.lm_head.weight.grad.clone()
    student.ar.zero_grad()
    k = replay.sample_step_per_block(4, torch.Generator().manual_seed(0))
    predicted = (replay.steps == k) & replay.batch.loss_mask.bool()
    full = student.shifted_logits(replay.batch, replay.state_before(k, MASK))
    with torch.no_grad():
        target = teacher_log_probs(without_mask_token(teacher_completion_logits(teacher, replay.batch)[predicted], MASK),
                                   settings.teacher_top_k)
    reference = token_divergence(without_mask_token(full[predicted], MASK), target, divergence, settings.jsd_beta).mean()
    reference.backward()
    torch.testing.assert_close(loss.detach(), reference.detach())
    torch.testing.assert_close(grad, student.ar.lm_head.weight.grad)


def test_focus_weights_start_at_the_first_focus_token_of_each_row():
    ids = torch.tensor([[5, 7, 9, 7, 6], [5, 6, 6, 6, 6]])
    w = focus_weights(ids, 7, 4.0)
    assert w.tolist() == [[1.0, 4.0, 4.0, 4.0, 4.0], [1.0] * 5]  # a row without it keeps weight 1
    assert focus_weights(ids, 7, 1.0).tolist() == [[1.0] * 5] * 2
    assert focus_weights(ids, None, 4.0).tolist() == [[1.0] * 5] * 2


def test_focused_opd_loss_is_the_weighted_mean_of_the_per_token_divergences():
    """Weight w on the tokens from the focus token on: the loss is sum(w * div) / sum(w) over the
    distilled slots, so it moves towards the focused span's divergence as w grows."""
    teacher = tiny_ar(seed=5)
    out, replay = rollouts(teacher, block_size=4, steps=3)
    student = BlockDiffusionLM(tiny_ar(seed=9), mask_id=MASK, block_size=4)
    ids = replay.batch.completion_ids
    supervised = replay.batch.loss_mask.bool()
    focus = next(int(t) for t in ids[0, 2:][supervised[0, 2:]])  # a token rows reach after their start
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731 - the same sampled step for each call
    plain, stats = opd_loss(student, teacher, replay, OpdSettings(student_mask="replay"), gen())
    weighted, wstats = opd_loss(student, teacher, replay,
                                OpdSettings(student_mask="replay", focus_token_id=focus, focus_weight=5.0), gen())
    assert wstats["divergence"] == pytest.approx(stats["divergence"])  # the logged figure stays unweighted
    in_span = (focus_weights(ids, focus, 2.0) > 1.0) & supervised
    assert bool(in_span.any()) and bool((supervised & ~in_span).any())
    fd = wstats["focus_divergence"]
    # the weighted mean lies between the plain mean and the focused span's mean, strictly
    assert min(float(plain), fd) < float(weighted) < max(float(plain), fd)
    assert 0.0 <= wstats["focus_agreement"] <= 1.0


def test_clean_view_term_vanishes_for_the_teacher_weights_and_adds_otherwise():
    """The clean term reads the student as a causal LM: with the teacher's own weights it is 0
    (inside a 4-slot block the masked-state term is not), with other weights it is positive and
    reaches the parameters through the plain causal forward."""
    teacher = tiny_ar(seed=5)
    out, replay = rollouts(teacher, block_size=4, steps=3)
    same = BlockDiffusionLM(tiny_ar(seed=5), mask_id=MASK, block_size=4)
    base, _ = opd_loss(same, teacher, replay, OpdSettings(), torch.Generator().manual_seed(0))
    both, stats = opd_loss(same, teacher, replay, OpdSettings(clean_weight=2.0), torch.Generator().manual_seed(0))
    assert float(base) > 1e-3 and float(both) == pytest.approx(float(base), abs=1e-5)
    assert stats["clean_divergence"] == pytest.approx(0.0, abs=1e-5) and stats["clean_agreement"] == 1.0
    other = BlockDiffusionLM(tiny_ar(seed=9).train(), mask_id=MASK, block_size=4)
    plain, _ = opd_loss(other, teacher, replay, OpdSettings(), torch.Generator().manual_seed(0))
    loss, ostats = opd_loss(other, teacher, replay, OpdSettings(clean_weight=2.0), torch.Generator().manual_seed(0))
    assert ostats["clean_divergence"] > 1e-3
    assert float(loss) == pytest.approx(float(plain) + 2.0 * ostats["clean_divergence"], rel=1e-4)
    loss.backward()
    assert all(p.grad is not None for p in other.ar.parameters() if p.requires_grad)


def test_focus_token_must_be_one_token_of_the_tokenizer(tmp_path):
    from dgr2.tokenizer.hf import build_tokenizer

    tok = build_tokenizer(["<a_1>", "<b_1>"], tmp_path)
    assert focus_token_id(tok, "<answer>") == tok.convert_tokens_to_ids("<answer>")
    with pytest.raises(ValueError, match="not a single token"):
        focus_token_id(tok, "no-such-word")


def test_teacher_logits_match_plain_ar_forward():
    teacher = tiny_ar()
    out, replay = rollouts(teacher)
    got = teacher_completion_logits(teacher, replay.batch)
    for i, (p, c) in enumerate(zip(PROMPTS, out.sequences)):
        ids = torch.tensor([p + c])
        ref = teacher(input_ids=ids).logits[0, len(p) - 1 : len(p) + len(c) - 1]
        assert torch.allclose(got[i, : len(c)], ref, atol=1e-4)


# ------------------------------------------------------------------ reward and advantages
def _answer(labels: list[int]) -> str:
    return "<think> x </think> <answer> " + " ".join(f"c{i + 1}" for i in labels) + " </answer> </s>"


def test_reward_on_hand_made_rankings():
    cfg = RewardConfig(invalid_reward=-1.0, echo_alpha=0.2)
    k = 10
    assert completion_reward(_answer([3, 0, 1, 2, 4, 5, 6, 7, 8, 9]), k, 3, cfg).reward == pytest.approx(1.2)
    assert completion_reward(_answer(list(range(10))), k, 0, cfg).reward == pytest.approx(1.0)  # echo: no bonus
    echo = completion_reward(_answer(list(range(10))), k, 4, cfg)
    assert echo.echoed and echo.reward == pytest.approx(1 / math.log2(6))
    last = completion_reward(_answer([1, 2, 3, 4, 5, 6, 7, 8, 9, 0]), k, 0, cfg)
    assert last.reward == pytest.approx(1 / math.log2(11) + 0.2)
    assert completion_reward(_answer([0, 0, 1, 2, 3, 4, 5, 6, 7, 8]), k, 0, cfg).reward == -1.0  # duplicate
    assert completion_reward(_answer([0, 1, 2, 3, 4, 5, 6, 7, 8]), k, 0, cfg).reward == -1.0  # missing
    assert completion_reward(_answer([0, 1, 2, 3, 4, 5, 6, 7, 8, 10]), k, 0, cfg).reward == -1.0  # out of set
    assert completion_reward("c1 c2 c3", k, 0, cfg).reward == -1.0  # no answer block
    with pytest.raises(ValueError):
        ranking_reward(parse_completion(_answer(list(range(10))), k), 10, cfg)
    with pytest.raises(ValueError):
        RewardConfig(invalid_reward=0.5)


def test_reward_of_a_scored_ranking_matches_the_parsed_one_and_reads_the_profile():
    """Evaluation rows (validity already decided) get the reward rollouts get; a target that is
    not among the candidates earns only the format term; the profile's RL settings are used."""
    cfg = RewardConfig(invalid_reward=-0.5, echo_alpha=0.1)
    for labels, target in [([3, 0, 1, 2, 4, 5, 6, 7, 8, 9], 3), (list(range(10)), 4), ([0, 0, 1, 2, 3, 4, 5, 6, 7, 8], 0)]:
        parsed = parse_completion(_answer(labels), 10)
        assert reward_of_ranking(parsed.valid, parsed.ranking, target, cfg) == ranking_reward(parsed, target, cfg)
    assert reward_of_ranking(True, [1, 0, 2], -1, cfg).reward == pytest.approx(0.1)
    assert reward_of_ranking(True, [0, 1, 2], -1, cfg).reward == 0.0
    rl = load_config("tiny", ["rl.invalid_reward=-2.0", "rl.echo_alpha=0.3"]).rl
    assert reward_config_of(rl) == RewardConfig(invalid_reward=-2.0, echo_alpha=0.3)


def test_group_advantages_normalise_within_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = group_advantages(rewards, groups)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-4)
    assert torch.equal(adv[4:], torch.zeros(2))  # constant group: no signal


def test_dropping_zero_advantage_groups_keeps_the_gradient_direction():
    """``with_signal`` leaves out trajectories with zero advantage; the policy-gradient sum is
    unchanged and only the token-mean normaliser shrinks to the kept tokens (DAPO)."""
    from dgr2.train.online import with_signal

    model = tiny_ar()
    out, _ = rollouts(model)
    adv = [1.0, 0.0, -1.0, 0.0]
    rows = [{"i": i, "advantage": a} for i, a in enumerate(adv)]
    kept = [r["i"] for r in with_signal(rows)]
    assert kept == [0, 2]
    assert with_signal([{"advantage": 0.0}, {"advantage": 0.0}]) == []

    def grads(idx):
        model.zero_grad()
        policy = BlockDiffusionLM(model.train(), mask_id=MASK, block_size=4)
        replay = ReplayBatch.collate([PROMPTS[i] for i in idx], [out.sequences[i] for i in idx],
                                     [out.unmask_steps[i] for i in idx], [out.tail_tokens[i] for i in idx],
                                     [out.tail_unmask_steps[i] for i in idx], [out.token_logprobs[i] for i in idx], PAD)
        loss, stats = rl_policy_loss(policy, replay, torch.tensor([adv[i] for i in idx]), RlSettings(temperature=1.0))
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return flat * stats["policy_tokens"]  # undo the token mean: the policy-gradient sum

    assert torch.allclose(grads(kept), grads([0, 1, 2, 3]), atol=1e-5, rtol=1e-4)
