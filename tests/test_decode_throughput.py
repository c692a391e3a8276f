"""The throughput benchmark runs end to end on a tiny grid and writes honest, complete rows."""

from __future__ import annotations

import json

import pytest

from dgr2.testing.scripts import load_script


def load_benchmark():
    return load_script("benchmarks/decode_throughput.py")


def test_benchmark_writes_json_and_plot(tmp_path):
    bench = load_benchmark()
    rows = bench.main([
        "--profile", "tiny", "--vocab-size", "64", "--lengths", "8", "16", "--batch-sizes", "1", "2",
        "--prompt-len", "6", "--block-size", "4", "--steps", "2", "--repeats", "1", "--out-dir", str(tmp_path),
        "--tag", "t",
    ])
    report = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.png").stat().st_size > 0
    assert report["random_init"] and len(report["rows"]) == 4 == len(rows)
    for row in report["rows"]:
        assert row["ratio"] == pytest.approx(row["diffusion_tokens_per_s"] / row["ar_tokens_per_s"])
        assert row["ar_forward_passes_per_sequence"] == row["length"]  # one pass per AR token
        # random init never reaches tau=0.9: the floor commits block/steps = 2 tokens per pass
        assert row["diffusion_forward_passes_per_sequence"] == row["length"] / 2
        assert row["diffusion_tokens_per_forward"] == pytest.approx(2.0)


def test_benchmark_times_the_whole_last_layer_side_by_side(tmp_path):
    rows = load_benchmark().main([
        "--profile", "tiny", "--vocab-size", "64", "--lengths", "8", "--batch-sizes", "2", "--prompt-len", "6",
        "--block-size", "4", "--steps", "2", "--repeats", "1", "--out-dir", str(tmp_path), "--tag", "w",
        "--whole-last-layer-too",
    ])
    (row,) = rows
    assert row["ratio_whole_last_layer"] == pytest.approx(row["diffusion_whole_tokens_per_s"] / row["ar_tokens_per_s"])
    assert row["diffusion_whole_forward_passes"] == row["diffusion_forward_passes"]  # same schedule, same tokens


def test_benchmark_refuses_steps_above_block_size():
    with pytest.raises(SystemExit):
        load_benchmark().parse_args(["--block-size", "4", "--steps", "8"])
