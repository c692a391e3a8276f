"""Paired gaps between rankers on the same requests (dgr2.eval.paired) and the scale-eval table."""

from __future__ import annotations

import json
import math

import pytest

from dgr2.eval.paired import (
    gaps_against,
    paired_difference,
    per_example_ndcg,
    proportion_standard_error,
    score_saved_completions,
)
from dgr2.eval.reward import RewardConfig
from dgr2.pipeline import completions_file
from dgr2.testing.scripts import load_script


def test_paired_difference_by_hand():
    gap = paired_difference([1, 0, 1, 1], [0, 0, 1, 0])
    # differences 1, 0, 0, 1: mean 0.5, sample variance 1/3, standard error sqrt(1/3 / 4)
    assert gap.n == 4 and gap.mean == 0.75 and gap.reference_mean == 0.25
    assert gap.difference == pytest.approx(0.5)
    assert gap.standard_error == pytest.approx(math.sqrt(1 / 12))
    assert gap.relative == pytest.approx(2.0)
    assert gap.z == pytest.approx(0.5 / math.sqrt(1 / 12))
    low, high = gap.interval()
    assert (low, high) == pytest.approx((0.5 - 1.96 * math.sqrt(1 / 12), 0.5 + 1.96 * math.sqrt(1 / 12)))


def test_pairing_removes_the_shared_difficulty():
    """Two rankers that differ by a constant 0.01 on users of very different difficulty: the
    paired error is 0 while an unpaired one would be large."""
    reference = [0.1 * (i % 10) for i in range(300)]
    gap = paired_difference([r - 0.01 for r in reference], reference)
    assert gap.difference == pytest.approx(-0.01)
    assert gap.standard_error == pytest.approx(0.0, abs=1e-12)
    assert gap.z < -1e6
    assert paired_difference(reference, reference).z == 0.0
    assert paired_difference([1.0, 1.0], [0.0, 0.0]).z == math.inf


def test_paired_difference_refuses_bad_samples():
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference([1.0, 0.0], [1.0])
    with pytest.raises(ValueError, match="at least 2"):
        paired_difference([1.0], [1.0])
    assert math.isnan(paired_difference([1.0, 0.0], [0.0, 0.0]).relative)


def test_proportion_standard_error():
    assert proportion_standard_error(297, 300) == pytest.approx(math.sqrt(0.99 * 0.01 / 300))
    assert proportion_standard_error(300, 300) == 0.0
    with pytest.raises(ValueError):
        proportion_standard_error(5, 0)
    with pytest.raises(ValueError):
        proportion_standard_error(301, 300)


def test_per_example_ndcg_reads_strict_ranks():
    rows = [{"strict_rank": 0}, {"strict_rank": 1}, {"strict_rank": -1}, {"strict_rank": 10}]
    assert per_example_ndcg(rows) == pytest.approx([1.0, 1 / math.log2(3), 0.0, 0.0])
    assert per_example_ndcg(rows, k=11)[3] == pytest.approx(1 / math.log2(12))


def test_gaps_against_the_reference_from_saved_completions(tmp_path):
    """Completions files re-scored in the examples' order, each model's gap against the
    reference, validity with its error; a file out of order is refused."""
    examples = [{"example_id": f"u{i}", "candidates": [10, 11, 12], "target_index": 0} for i in range(4)]
    answers = {
        "ar_sft": ["c1 c2 c3", "c1 c2 c3", "c2 c1 c3", "c1 c2 c3"],
        "cft": ["c2 c1 c3", "c1 c2 c3", "c1 c1 c3", "c1 c2 c3"],
    }

    def write(name, texts, ids=None):
        lines = [json.dumps({"example_id": ex_id, "completion": f"<answer> {t} </answer>"})
                 for ex_id, t in zip(ids or [ex["example_id"] for ex in examples], texts)]
        completions_file(tmp_path, name, "test").write_text("\n".join(lines))

    for name, texts in answers.items():
        write(name, texts)
    scored = {name: score_saved_completions(completions_file(tmp_path, name, "test"), examples) for name in answers}
    assert [r["valid"] for r in scored["cft"]] == [True, True, False, True]
    rows = gaps_against(scored, "ar_sft")
    assert rows["ar_sft"]["gap_vs_reference"] == 0.0 and rows["ar_sft"]["valid_rate"] == 1.0
    # cft: user 0 rank 1 instead of 0, user 2 invalid -> retriever order (rank 0) instead of rank 1
    second = 1 / math.log2(3)
    assert rows["cft"]["gap_vs_reference"] == pytest.approx(((second - 1) + (1 - second)) / 4)
    assert rows["cft"]["valid_rate"] == 0.75
    assert rows["cft"]["valid_se"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    # RL's reward (default: invalid -1, 0.2 for a valid non-echo): AR echoes on users 0, 1, 3
    # (1.0 each) and puts the target second on user 2 (second + 0.2); CFT puts it second on user 0
    # and is invalid on user 2, so the paired reward gap is ((second + 0.2 - 1) + (-1 - second - 0.2)) / 4
    assert rows["ar_sft"]["reward"] == pytest.approx((3 + second + 0.2) / 4)
    assert rows["cft"]["reward_gap"] == pytest.approx(-0.5)
    assert rows["cft"]["reward_gap_se"] > 0
    harsher = gaps_against(scored, "ar_sft", RewardConfig(invalid_reward=-3.0, echo_alpha=0.0))
    assert harsher["cft"]["reward_gap"] == pytest.approx(((second - 1) + (-3 - second)) / 4)
    write("cft", answers["cft"], ids=["u1", "u0", "u2", "u3"])
    with pytest.raises(RuntimeError, match="not in the examples' order"):
        score_saved_completions(completions_file(tmp_path, "cft", "test"), examples)
    with pytest.raises(KeyError, match="reference"):
        gaps_against(scored, "ar_rl")


def test_paired_gaps_script_pairs_stage_against_stage_and_refuses_bad_names(tmp_path):
    """Any saved row can be the reference (here CFT, for OPD's gain over it); names come from the
    command line, so two files with the same stage name can be told apart."""
    script = load_script("benchmarks/paired_gaps.py")
    examples = [{"example_id": f"u{i}", "candidates": [10, 11, 12], "target_index": 0} for i in range(4)]
    answers = {"cft": ["c2 c1 c3", "c1 c2 c3", "c1 c1 c3", "c1 c2 c3"],
               "opd": ["c1 c2 c3", "c1 c2 c3", "c1 c2 c3", "c3 c2 c1"]}
    for name, texts in answers.items():
        (tmp_path / name).mkdir()
        completions_file(tmp_path / name, "cft", "test").write_text("\n".join(
            json.dumps({"example_id": ex["example_id"], "completion": f"<answer> {t} </answer>"})
            for ex, t in zip(examples, texts)))
    pairs = [f"{name}={completions_file(tmp_path / name, 'cft', 'test')}" for name in answers]
    files = script.named_files(pairs)
    rows = script.write_paired_table(files, "cft", examples, tmp_path / "out", "test")
    # opd against cft: user 0 rank 0 vs 1 (+), user 2 valid rank 0 vs invalid -> retriever rank 0
    # (0), user 3 rank 2 vs 0 (-)
    second, third = 1 / math.log2(3), 1 / math.log2(4)
    assert rows["opd"]["gap_vs_reference"] == pytest.approx(((1 - second) + (third - 1)) / 4)
    assert rows["cft"]["gap_vs_reference"] == 0.0 and rows["opd"]["valid_rate"] == 1.0
    table = json.loads((tmp_path / "out" / "paired_cft_test_n4.json").read_text())
    assert table["rows"]["opd"]["gap_vs_reference"] == pytest.approx(rows["opd"]["gap_vs_reference"])

    with pytest.raises(SystemExit, match="given twice"):
        script.named_files([pairs[0], pairs[0]])
    with pytest.raises(SystemExit, match="NAME=FILE"):
        script.named_files([str(completions_file(tmp_path / "cft", "cft", "test"))])
    with pytest.raises(SystemExit, match="no file"):
        script.named_files([f"rl={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(SystemExit, match="--reference 'ar_sft'"):
        script.write_paired_table(files, "ar_sft", examples, tmp_path / "out", "test")
