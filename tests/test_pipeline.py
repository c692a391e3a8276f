"""The tiny profile end to end through the real flow: stages build, then a rerun skips them all."""

from __future__ import annotations

import json

import pytest

from dgr2.config import load_config
from dgr2.pipeline import STAGE_ORDER


@pytest.mark.slow
def test_tiny_pipeline_runs_then_reuses_every_stage(tmp_path, ray_session, beauty_dir, monkeypatch):
    from dgr2.testing.scripts import load_script

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    flow = load_script("flows/full_pipeline.py")
    args = ["--config", "tiny", "--set", f"pipeline.runs_dir={tmp_path}"]

    first = flow.main(args + ["--run-name", "first"])
    assert list(first) == STAGE_ORDER
    assert not any(out.cached for out in first.values())
    table = json.loads(first["eval"].file("test_json").read_text())
    rows = table["rows"] if "rows" in table else table
    assert {"retriever", "popularity", "random", "ar_sft"} <= set(rows)
    for name in ("valid_rate", "duplicate_rate", "missing_rate", "out_of_set_rate"):
        assert 0.0 <= rows["ar_sft"][name] <= 1.0
    assert (first["sft"].file("model") / "model.safetensors").is_file()
    assert first["eval"].file("test_png").stat().st_size > 1000
    fidelity = first["eval"].manifest["stats"]["trace_fidelity"]
    assert set(fidelity) == {"valid", "test"}
    assert 0.0 <= fidelity["test"]["a_error"] <= 1.0 and fidelity["test"]["examples"] > 0
    # every diffusion stage leaves a block-diffusion checkpoint and an eval on both splits
    for name in ("naive", "mdm", "cft", "opd", "rl"):
        assert (first[name].file("model") / "block_diffusion.json").is_file()
        assert set(first[name].manifest["stats"]["eval"]) == {"valid", "test"}
    recipe = json.loads(first["report"].file("test_json").read_text())["rows"]
    assert {"popularity", "ar_sft", "naive", "mdm", "cft", "opd", "rl"} <= set(recipe)
    # every row's paired NDCG@10 gap to AR on the same users; AR against itself is exactly 0
    gaps = json.loads(first["report"].file("test_gaps_json").read_text())["rows"]
    assert set(gaps) == {"ar_sft", "ar_sft_rl", "naive", "mdm", "cft", "opd", "rl"}
    assert gaps["ar_sft"]["gap_vs_reference"] == 0.0 and gaps["ar_sft"]["gap_se"] == 0.0
    for name, row in gaps.items():
        assert row["ndcg@10"] == pytest.approx(recipe[name]["ndcg@10"])
        assert row["valid_rate"] == pytest.approx(recipe[name]["valid_rate"])
        assert row["gap_vs_reference"] == pytest.approx(row["ndcg@10"] - gaps["ar_sft"]["ndcg@10"])
    tau = json.loads(first["report"].file("tau_json").read_text())["rows"]
    # the tiny profile sweeps both commit orders at each tau
    assert {"ar_sft", "rl_l2r_tau1", "rl_l2r_tau0.5", "rl_conf_tau1", "rl_conf_tau0.5"} <= set(tau)
    assert tau["rl_block8"]["tokens_per_forward"] <= 8.0  # the decode-block row: a pass commits within 8 slots
    assert all(row["tokens_per_s_b1"] > 0 and row["speedup_vs_ar_b1"] > 0 for row in tau.values())
    assert tau["ar_sft"]["tokens_per_forward_b1"] == 1.0  # AR: one token a pass, counted the same way
    assert 1.0 <= tau["rl_l2r_tau0.5"]["tokens_per_forward_b1"] <= 32.0
    for name in ("opd", "rl"):  # online stages: one policy version per step, all trajectories on-policy
        history = json.loads(first[name].file("history").read_text())
        assert [h["rollout/policy_version"] for h in history] == [float(i + 1) for i in range(len(history))]
        assert all(h["rollout/stale_fraction"] == 0.0 for h in history)
        assert all(h["rollout/trajectories"] > 0 for h in history)
    register = first["register"].manifest["stats"]
    assert register["model_uri"] == "models:/dgr2-reranker/1"
    bundle_meta = json.loads((first["register"].file("bundle") / "bundle.json").read_text())
    assert bundle_meta["decoding"]["commit_order"] == "left_to_right"  # the serving default follows the profile

    second = flow.main(args + ["--run-name", "second"])
    assert all(out.cached for out in second.values())
    assert {n: o.path for n, o in second.items()} == {n: o.path for n, o in first.items()}

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=[load_config("tiny").tracking.experiment], output_format="list")
    stage_runs = [r for r in runs if "dgr2.stage" in r.data.tags]
    assert len(stage_runs) == 2 * len(STAGE_ORDER)
    cached = [r.data.tags["dgr2.cached"] for r in stage_runs if r.data.tags.get("mlflow.parentRunId")]
    assert cached.count("True") == len(STAGE_ORDER)
    sft_runs = [r for r in stage_runs if r.data.tags["dgr2.stage"] == "sft" and r.data.tags["dgr2.cached"] == "False"]
    history = mlflow.tracking.MlflowClient().get_metric_history(sft_runs[0].info.run_id, "train/loss")
    assert len(history) >= 2  # per-step loss logged from the rank-0 worker

    from dgr2.serving.bundle import load_bundle

    bundle = load_bundle("models:/dgr2-reranker/1")  # the registered final model, as Serve loads it
    assert bundle.meta.kind == "diffusion" and bundle.meta.has_ar_model


def test_ablations_switch_leaves_comparison_stages_out_of_the_closure():
    from dgr2.pipeline import OPTIONAL_STAGES, closure

    full = closure(["report"])
    assert set(OPTIONAL_STAGES) <= set(full)
    lean = closure(["report"], ablations=[])
    assert not set(OPTIONAL_STAGES) & set(lean)
    assert {"cft", "opd", "rl", "naive", "report"} <= set(lean)
    assert closure(["report"], ablations=["ar_rl"]) == [s for s in full if s != "mdm"]


def test_default_profile_is_the_lean_recipe_and_beauty_the_measured_one():
    default, beauty, tiny = load_config("default"), load_config("beauty"), load_config("tiny")
    assert default.pipeline.ablations == [] and tiny.pipeline.ablations == ["ar_rl", "mdm"]
    assert default.sft.max_steps < beauty.sft.max_steps and default.cft.max_steps < beauty.cft.max_steps
    # the lean profile changes step counts and evaluation size, not the model or the trace grammar
    assert default.model == beauty.model and default.traces == beauty.traces and default.diffusion == beauty.diffusion


def test_flow_refuses_a_switched_off_stage_by_name(tmp_path):
    from dgr2.testing.scripts import load_script

    flow = load_script("flows/full_pipeline.py")
    with pytest.raises(SystemExit, match="pipeline.ablations"):
        flow.main(["--config", "default", "--stages", "mdm", "--set", f"pipeline.runs_dir={tmp_path}"])
    assert not any(tmp_path.iterdir())  # refused before a run folder was made


def test_cft_and_mdm_keys_each_follow_only_their_own_step_count():
    from dgr2.pipeline import _cft_section, _key, _mdm_train_cfg
    from dgr2.stage_store import StageOutput

    cfg = load_config("tiny")
    inputs = [StageOutput("sft", "k0", None, {}, cached=True)]

    def keys(c):
        cft = _key("cft", c, ("model",), inputs, replace={"cft": _cft_section(c.cft)})
        mdm = _key("mdm", c, ("model",), inputs, replace={"cft": _cft_section(_mdm_train_cfg(c))})
        return cft, mdm

    base = keys(cfg)
    more_generic = keys(load_config("tiny", ["cft.generic_steps=5"]))
    more_cft = keys(load_config("tiny", ["cft.max_steps=9"]))
    assert more_generic[0] == base[0] and more_generic[1] != base[1]
    assert more_cft[1] == base[1] and more_cft[0] != base[0]


@pytest.mark.parametrize("stage, section, field, neutral, other", [
    ("naive", "diffusion", "defer_repeats", "false", "true"),
    ("report", "eval", "decode_block_sweep", "[]", "[8]"),
    ("report", "diffusion", "head_chunk", "8", "0"),
    ("report", "diffusion", "ranking_threshold", "null", "0.97"),
    ("cft", "cft", "focus_weight", "1.0", "4.0"),
    ("cft", "cft", "focus_token", "order", "<answer>"),
])
def test_a_field_added_later_leaves_old_keys_alone_at_its_neutral_value(stage, section, field, neutral, other):
    """At its neutral value a field added later (``diffusion.defer_repeats=false``: the decoding
    rule from before the field existed; ``eval.decode_block_sweep=[]``: no extra rows) gives the
    key computed without the field; any other value gets a new key."""
    import yaml

    from dgr2.pipeline import KEY_NEUTRAL_FIELDS, SINGLE_STAGE_FIELDS, STAGE_VERSIONS, _key
    from dgr2.stage_store import StageOutput, stage_key

    assert KEY_NEUTRAL_FIELDS[(section, field)] == yaml.safe_load(neutral)
    inputs = [StageOutput("sft", "k0", None, {}, cached=True)]
    off = load_config("tiny", [f"{section}.{field}={neutral}"])
    on = load_config("tiny", [f"{section}.{field}={other}"])
    without = getattr(off, section).model_dump(mode="json")
    for other_section, other_field in KEY_NEUTRAL_FIELDS:  # every field the section added later, at its default
        if other_section == section and without.get(other_field) == KEY_NEUTRAL_FIELDS[(section, other_field)]:
            del without[other_field]
    for (other_section, other_field), owner in SINGLE_STAGE_FIELDS.items():  # another stage's field
        if other_section == section and owner != stage:
            without.pop(other_field, None)
    assert field not in without
    before = stage_key(stage, STAGE_VERSIONS[stage], {"config": {section: without}, "inputs": {"sft": "k0"}})
    assert _key(stage, off, (section,), inputs) == before
    assert _key(stage, on, (section,), inputs) != before


@pytest.mark.parametrize("section, field, plain, changed", [
    ("eval", "decode_block_sweep", "[]", "[8]"),
    ("diffusion", "ranking_threshold", "null", "0.97"),
])
def test_a_field_one_stage_reads_stays_out_of_the_other_stages_keys(section, field, plain, changed):
    """The decode-block sweep and the ranking sections' bar are the report's (decode-time rules
    of its rows and the served bundle): the evaluations, CFT/OPD/RL and their training must not
    re-run when either changes."""
    from dgr2.pipeline import SINGLE_STAGE_FIELDS, _key
    from dgr2.stage_store import StageOutput

    assert SINGLE_STAGE_FIELDS[(section, field)] == "report"
    inputs = [StageOutput("sft", "k0", None, {}, cached=True)]
    off = load_config("tiny", [f"{section}.{field}={plain}"])
    on = load_config("tiny", [f"{section}.{field}={changed}"])
    for stage in ("eval", "naive", "mdm", "cft", "opd", "rl"):
        assert _key(stage, off, ("eval", "diffusion"), inputs) == _key(stage, on, ("eval", "diffusion"), inputs)
    assert _key("report", off, ("eval", "diffusion"), inputs) != _key("report", on, ("eval", "diffusion"), inputs)


def test_the_ranking_threshold_is_inert_below_tau_and_its_marker_must_be_a_token():
    """Below tau ``diffusion.ranking_threshold`` is inert (applied as the larger of the two), not
    refused, so a tau sweep above it still loads; a marker the tokenizer lacks is refused."""
    from types import SimpleNamespace

    from dgr2.eval.model_eval import strict_section_ids

    cfg = load_config("tiny", ["diffusion.confidence_threshold=1.0", "diffusion.ranking_threshold=0.8"])
    assert cfg.diffusion.ranking_threshold == 0.8
    vocab = {"order": 7, "<unk>": 1}
    tokenizer = SimpleNamespace(unk_token_id=1,
                                convert_tokens_to_ids=lambda tokens: [vocab.get(t, 1) for t in tokens])
    assert strict_section_ids(tokenizer, "order") == [7]
    with pytest.raises(ValueError, match="not a token"):
        strict_section_ids(tokenizer, "ordre")


def test_a_decode_block_larger_than_the_trained_block_is_refused():
    with pytest.raises(ValueError, match="exceeds diffusion.block_size"):
        load_config("tiny", ["eval.decode_block_sweep=[64]", "diffusion.block_size=32"])
    assert load_config("tiny", ["eval.decode_block_sweep=[16,8]"]).eval.decode_block_sweep == [16, 8]


def test_flow_refuses_a_run_name_already_taken(tmp_path):
    from dgr2.testing.scripts import load_script

    flow = load_script("flows/full_pipeline.py")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "summary.json").write_text("{}")
    with pytest.raises(SystemExit, match="'taken'.*already exists.*pick another name"):
        flow.main(["--config", "tiny", "--run-name", "taken", "--set", f"pipeline.runs_dir={tmp_path}"])
    assert (tmp_path / "taken" / "summary.json").read_text() == "{}"  # the old run is left as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # nothing else made
