"""The pipeline's stages: each takes the config plus its inputs' outputs, returns its own.

Data flows one way: files -> examples (Parquet) -> SIDs + tokenizer -> traces -> tokenized
batches -> AR SFT checkpoint -> evaluation (baselines + AR) -> the block-diffusion recipe, each
step a checkpoint plus an evaluation on the same valid/test sets: ``naive`` (the SFT weights
decoded as a block-diffusion model, no training), ``mdm`` (the same plus generic masked-denoising
fine-tuning on prompt text only), ``cft`` (conversion fine-tuning on the teacher trajectories),
``opd`` (on-policy distillation from the AR teacher), ``rl`` (GRPO on the re-ranking reward)
-> ``report`` (the one table, the speed/accuracy curve over the decoding threshold, curves).  Every stage is cached in the :class:`StageStore`
under a key that hashes the config sections it reads and its inputs' keys, so a rerun skips
finished stages and a killed one resumes in its ``.partial`` folder.  ``flows/full_pipeline.py``
only wires these together and talks to MLflow.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, get_args

from dgr2.config import Config, OptionalStage
from dgr2.stage_store import StageOutput, StageStore, stage_key

log = logging.getLogger(__name__)

# Bump a stage's version when its code changes what it writes (invalidates its cache).
STAGE_VERSIONS = {
    "data": "3", "vocab": "5", "traces": "5", "sft": "1", "eval": "3",
    "naive": "1", "mdm": "1", "cft": "1", "opd": "1", "rl": "1", "report": "6", "register": "1", "ar_rl": "1",
}
# Each stage and the stages whose outputs it reads (the flow resolves these first).
STAGE_INPUTS: dict[str, list[str]] = {
    "data": [],
    "vocab": ["data"],
    "traces": ["data", "vocab"],
    "sft": ["vocab", "traces"],
    "eval": ["data", "vocab", "traces", "sft"],
    "ar_rl": ["data", "vocab", "sft"],
    "naive": ["data", "vocab", "sft"],
    "mdm": ["data", "vocab", "sft"],
    "cft": ["data", "vocab", "traces", "sft"],
    "opd": ["data", "vocab", "sft", "cft"],
    "rl": ["data", "vocab", "opd"],
    "report": ["data", "vocab", "sft", "eval", "ar_rl", "naive", "mdm", "cft", "opd", "rl"],
    "register": ["vocab", "sft", "rl", "report"],
}
STAGE_ORDER = list(STAGE_INPUTS)
# stages handed the MLflow URI and their run id (per-step metrics, model registration)
TRACKED_STAGES = ("sft", "ar_rl", "mdm", "cft", "opd", "rl", "register")


# Config fields added after stages were cached, with the value that reproduces the behaviour from
# before they existed: at that value a field is left out of the key, so caches built before it
# stay valid; any other value is part of the key.
KEY_NEUTRAL_FIELDS: dict[tuple[str, str], Any] = {
    ("diffusion", "defer_repeats"): False, ("diffusion", "head_chunk"): 8, ("eval", "decode_block_sweep"): [],
    ("diffusion", "ranking_threshold"): None, ("diffusion", "ranking_marker"): "order",
    ("opd", "focus_weight"): 1.0, ("opd", "focus_token"): "<answer>", ("opd", "clean_weight"): 0.0,
    ("cft", "focus_weight"): 1.0, ("cft", "focus_token"): "order",
}
# a field only one stage reads stays out of every other stage's key, so changing it re-runs that
# stage alone (the decode-block sweep is the report's; CFT/OPD/RL evaluate at the trained block)
SINGLE_STAGE_FIELDS: dict[tuple[str, str], str] = {
    ("eval", "decode_block_sweep"): "report",
    # a decode-time rule of the report's rows and the served model (its bundle is keyed by the
    # report); the training stages' rollouts and their own evaluations decode without it
    ("diffusion", "ranking_threshold"): "report", ("diffusion", "ranking_marker"): "report",
}


def _key(stage: str, cfg: Config, sections: tuple[str, ...], inputs: list[StageOutput],
         replace: dict[str, dict[str, Any]] | None = None) -> str:
    """The cache key of ``stage``: its code version, the config sections it reads (``replace``
    swaps in a section as the stage actually uses it) and its inputs' keys."""
    config = {s: getattr(cfg, s).model_dump(mode="json") for s in sections}
    config.update(replace or {})
    for (section, field), neutral in KEY_NEUTRAL_FIELDS.items():
        if section in config and config[section].get(field, neutral) == neutral:
            config[section].pop(field, None)
    for (section, field), owner in SINGLE_STAGE_FIELDS.items():
        if section in config and stage != owner:
            config[section].pop(field, None)
    payload = {"config": config, "inputs": {o.stage: o.key for o in inputs}}
    return stage_key(stage, STAGE_VERSIONS[stage], payload)


def _cft_section(train_cfg) -> dict[str, Any]:
    """The key section of a stage trained with the CFT loss: the settings it trains with, less
    ``generic_steps`` (CFT runs ``cft.max_steps``, the generic-MDM ablation ``cft.generic_steps``
    through :func:`_mdm_train_cfg`), so neither key moves when the other's step count does."""
    section = train_cfg.model_dump(mode="json")
    section.pop("generic_steps")
    return section


def _mdm_train_cfg(cfg: Config):
    """The generic-MDM ablation trains with the CFT settings for ``cft.generic_steps`` steps."""
    return cfg.cft.model_copy(update={"max_steps": cfg.cft.generic_steps})


# --------------------------------------------------------------------------- data
def run_data(cfg: Config, store: StageStore, **_) -> StageOutput:
    """Load the dataset folder, split, build candidate lists; Parquet per split."""
    from dgr2.data.prepare import prepare_examples

    key = _key("data", cfg, ("data",), [])

    def build(work: Path) -> dict[str, Any]:
        prepared = prepare_examples(cfg.data, work)
        rel = prepared.dir.relative_to(work)
        return {
            "outputs": {
                **{split: str(rel / p.name) for split, p in prepared.files.items()},
                "item_stats": str(rel / prepared.item_stats.name),
            },
            "stats": prepared.stats,
            "content_hash": prepared.content_hash,
        }

    return store.run("data", key, build)


def load_split(data: StageOutput, split: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(data.file(split)).to_pylist()


def _item_stats_column(data: StageOutput, column: str) -> dict[str, int]:
    import pyarrow.parquet as pq

    table = pq.read_table(data.file("item_stats"), columns=["item_id", column])
    return dict(zip(table.column("item_id").to_pylist(), table.column(column).to_pylist()))


def item_counts(data: StageOutput) -> dict[str, int]:
    """Train interactions of each item (the popularity baseline's key)."""
    return _item_stats_column(data, "train_count")


def item_pop_buckets(data: StageOutput) -> dict[str, int]:
    """The popularity bucket the data stage gave each item (prompts must show exactly these)."""
    return _item_stats_column(data, "pop_bucket")


# --------------------------------------------------------------------------- vocab
def run_vocab(cfg: Config, store: StageStore, data: StageOutput, **_) -> StageOutput:
    """Semantic IDs from keyword levels, the item catalog and the HF tokenizer."""
    from dgr2.data.loader import load_raw_dataset
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import build_tokenizer
    from dgr2.tokenizer.sid import build_semantic_ids

    key = _key("vocab", cfg, ("sid",), [data])

    def build(work: Path) -> dict[str, Any]:
        raw = load_raw_dataset(Path(cfg.data.path))
        sids = build_semantic_ids(raw.keywords, levels=cfg.sid.levels)
        catalog = ItemCatalog.from_buckets(sids, item_pop_buckets(data))
        catalog.save(work / "catalog.json")
        tokenizer = build_tokenizer(sids.tokens(), work / "tokenizer")
        return {
            "outputs": {"catalog": "catalog.json", "tokenizer": "tokenizer"},
            "stats": {"sid": sids.report, "vocab_size": len(tokenizer)},
        }

    return store.run("vocab", key, build)


# --------------------------------------------------------------------------- traces
def run_traces(cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, **_) -> StageOutput:
    """Teacher traces by rejection sampling, then tokenized training rows for SFT."""
    import pyarrow.parquet as pq

    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import load_tokenizer
    from dgr2.traces.build import build_trace_dataset
    from dgr2.traces.teacher import make_teacher
    from dgr2.train.batches import tokenize_pairs, write_tokenized

    key = _key("traces", cfg, ("traces", "model"), [data, vocab])

    def build(work: Path) -> dict[str, Any]:
        catalog = ItemCatalog.load(vocab.file("catalog"))
        train = load_split(data, "train")
        teacher = make_teacher(cfg.traces, catalog, train)
        traces = build_trace_dataset(train, catalog, teacher, cfg.traces, work)
        table = pq.read_table(traces.path)
        tokenizer = load_tokenizer(vocab.file("tokenizer"))
        tokens = tokenize_pairs(
            table.column("prompt").to_pylist(), table.column("completion").to_pylist(),
            tokenizer, cfg.model.max_position_embeddings,
        )
        write_tokenized(tokens, work / "sft_tokens.parquet")
        lengths = [len(r) for r in tokens.column("input_ids").to_pylist()]
        completion = [n - p for n, p in zip(lengths, tokens.column("prompt_len").to_pylist())]
        return {
            "outputs": {"traces": str(traces.path.relative_to(work)), "tokens": "sft_tokens.parquet"},
            "stats": {
                **traces.report,
                "num_rows": len(lengths),
                "mean_tokens": sum(lengths) / max(len(lengths), 1),
                "mean_completion_tokens": sum(completion) / max(len(completion), 1),
            },
        }

    return store.run("traces", key, build)


# --------------------------------------------------------------------------- sft
def run_sft(
    cfg: Config, store: StageStore, vocab: StageOutput, traces: StageOutput,
    mlflow_uri: str | None = None, mlflow_run_id: str | None = None, **_,
) -> StageOutput:
    """AR SFT on prompt + trace + answer under Ray Train + DeepSpeed ZeRO."""
    from dgr2.train.harness import StageJob, run_stage

    key = _key("sft", cfg, ("model", "sft"), [vocab, traces])

    def build(work: Path) -> dict[str, Any]:
        job = StageJob(
            stage="sft", loss="sft", train=cfg.sft.model_dump(mode="json"),
            model=cfg.model.model_dump(mode="json"), tokenizer_dir=str(vocab.file("tokenizer")),
            data_path=str(traces.file("tokens")), storage_dir=str(work / "ray_train"),
            init_model_dir=cfg.model.pretrained_path, mlflow_uri=mlflow_uri, mlflow_run_id=mlflow_run_id,
        )
        result = run_stage(job)
        shutil.copytree(result.model_dir, work / "model")
        shutil.copytree(result.checkpoint_dir / "tokenizer", work / "tokenizer")
        history = result.metrics.pop("history", [])
        (work / "history.json").write_text(json.dumps(history, indent=1))
        return {
            "outputs": {"model": "model", "tokenizer": "tokenizer", "history": "history.json"},
            "stats": {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str))},
        }

    return store.run("sft", key, build)


# --------------------------------------------------------------------------- evaluation helper
def _decoder(cfg: Config, kind: str, model, tokenizer, threshold: float | None = None, batch_size: int | None = None,
             commit_order: str | None = None, block_size: int | None = None, ranking_threshold: float | None = None):
    """The decode callable of an evaluation: greedy AR, or block diffusion with cfg.diffusion
    (``threshold`` / ``commit_order`` / ``block_size`` override its decoding rule;
    ``ranking_threshold`` adds the ranking sections' bar, ``diffusion.ranking_marker`` on)."""
    from dgr2.decoding.ar import ar_generate
    from dgr2.decoding.block_diffusion import diffusion_generate
    from dgr2.decoding.block_loop import decode_block_steps
    from dgr2.eval.model_eval import stop_token_ids, strict_section_ids
    from dgr2.models.block_diffusion import mask_id_from_tokenizer

    stops = stop_token_ids(tokenizer)
    common = dict(max_new_tokens=cfg.eval.max_new_tokens, eos_id=tokenizer.eos_token_id,
                  pad_id=tokenizer.pad_token_id, stop_ids=stops, batch_size=batch_size or cfg.eval.batch_size)
    if kind == "ar":
        return lambda prompt_ids: ar_generate(model, prompt_ids, **common)
    d = cfg.diffusion
    tau = d.confidence_threshold if threshold is None else threshold
    block = block_size or d.block_size
    steps = decode_block_steps(d.max_steps_per_block, d.block_size, block)
    # the ranking sections' bar (dgr2.decoding.commit, strict sections): only where asked for,
    # never below this decode's tau
    strict: dict[str, Any] = {}
    if ranking_threshold is not None:
        strict = dict(strict_threshold=max(ranking_threshold, tau),
                      strict_after=strict_section_ids(tokenizer, d.ranking_marker))
    return lambda prompt_ids: diffusion_generate(
        model, prompt_ids, block_size=block, max_steps_per_block=steps, threshold=tau,
        mask_id=mask_id_from_tokenizer(tokenizer), commit_order=commit_order or d.commit_order,
        defer_repeats=d.defer_repeats, head_chunk=d.head_chunk, **strict, **common,
    )


def completions_file(folder: Path, name: str, split: str) -> Path:
    """Where :func:`evaluate_model` writes ``name``'s completions on ``split`` (one JSON line per
    example); the report and the scale evaluation read them back from here."""
    return Path(folder) / f"completions_{name}_{split}.jsonl"


def evaluate_model(
    cfg: Config, data: StageOutput, vocab: StageOutput, model_dir: Path, tokenizer_dir: Path, kind: str,
    name: str, work: Path, splits: list[str] | None = None, threshold: float | None = None,
    fidelity_teacher: Any = None, commit_order: str | None = None, block_size: int | None = None,
    ranking_threshold: float | None = None,
) -> dict[str, dict[str, float]]:
    """Decode ``model_dir`` on each split, score strictly; write ``<name>_<split>.json`` and the
    completions; return one results-table row per split (ranking, structure, tokens/s).

    With ``fidelity_teacher`` (a rule teacher) the JSON also holds the field-by-field trace
    error rates of the completions (:mod:`dgr2.traces.fidelity`)."""
    import torch

    from dgr2.eval.model_eval import evaluate_decoder, flat_row
    from dgr2.models.ar import load_model
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import load_tokenizer

    torch.manual_seed(cfg.data.seed)
    catalog = ItemCatalog.load(vocab.file("catalog"))
    tokenizer = load_tokenizer(tokenizer_dir)
    model = load_model(model_dir)
    decode = _decoder(cfg, kind, model, tokenizer, threshold, commit_order=commit_order, block_size=block_size,
                      ranking_threshold=ranking_threshold)
    rows: dict[str, dict[str, float]] = {}
    for split in splits or cfg.eval.splits:
        examples = load_split(data, split)
        t0 = time.perf_counter()
        evaluated = evaluate_decoder(decode, tokenizer, catalog, examples)
        log.info("eval %s %s: %d examples in %.1fs (%.0f tok/s)", name, split, len(examples),
                 time.perf_counter() - t0, evaluated.decode["tokens_per_s"])
        row = flat_row(evaluated)
        row["tokens_per_forward"] = evaluated.decode["mean_tokens_per_sequence"] / max(evaluated.decode["mean_passes_per_sequence"], 1e-9)
        row["mean_completion_tokens"] = evaluated.decode["mean_tokens_per_sequence"]
        rows[split] = row
        payload = {"eval": evaluated.result, "decode": evaluated.decode}
        if fidelity_teacher is not None:
            from dgr2.traces.fidelity import trace_fidelity

            payload["trace_fidelity"] = trace_fidelity(fidelity_teacher, examples, evaluated.completions)
            log.info("trace fidelity %s %s: %s", name, split,
                     {k: round(v, 3) for k, v in payload["trace_fidelity"].items()})
        (work / f"{name}_{split}.json").write_text(json.dumps(payload, indent=1))
        completions_file(work, name, split).write_text(
            "\n".join(json.dumps({"example_id": ex["example_id"], "completion": c})
                      for ex, c in zip(examples, evaluated.completions))
        )
    return rows


def _rule_teacher(traces: StageOutput, vocab: StageOutput) -> Any:
    """The traces stage's fitted rule teacher, or None when another teacher wrote the traces."""
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.traces.build import RULE_TEACHER_FILE
    from dgr2.traces.rule_teacher import RuleTeacher

    path = traces.path / RULE_TEACHER_FILE
    return RuleTeacher.load(path, ItemCatalog.load(vocab.file("catalog"))) if path.is_file() else None


def _request_decoders(cfg: Config, data: StageOutput, vocab: StageOutput, split: str,
                      specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Batch-1 decoders for the first ``cfg.eval.latency_examples`` prompts of ``split``, one per
    sweep row (``specs``: name -> model_dir, tokenizer_dir, kind and decoding overrides); a model
    directory is loaded once however many rows decode with it.

    Why batch 1 beside the batch figure: a batched CPU pass is compute-bound, so a pass over a
    32-slot block costs far more than an AR pass over one token a row; a single request is the
    Serve case and the paper's regime, where the speed-up is the tokens committed per pass
    divided by what a block pass costs relative to an AR pass (2.2x on 2 CPU cores, near 1 where
    a pass is bound by memory and launches)."""
    import torch

    from dgr2.eval.latency import RequestDecoder
    from dgr2.eval.model_eval import encode_prompts
    from dgr2.models.ar import load_model
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import load_tokenizer

    torch.manual_seed(cfg.data.seed)
    catalog = ItemCatalog.load(vocab.file("catalog"))
    examples = load_split(data, split)[: cfg.eval.latency_examples]
    models: dict[str, Any] = {}
    tokenizers: dict[str, Any] = {}
    prompts: dict[str, list[list[int]]] = {}
    decoders: dict[str, Any] = {}
    for name, spec in specs.items():
        model_dir, tok_dir = str(spec["model_dir"]), str(spec["tokenizer_dir"])
        if model_dir not in models:
            models[model_dir] = load_model(model_dir)
        if tok_dir not in tokenizers:
            tokenizers[tok_dir] = load_tokenizer(tok_dir)
            prompts[tok_dir] = encode_prompts(tokenizers[tok_dir], catalog, examples)
        decode = _decoder(cfg, spec["kind"], models[model_dir], tokenizers[tok_dir], spec.get("threshold"), batch_size=1,
                          commit_order=spec.get("commit_order"), block_size=spec.get("block_size"),
                          ranking_threshold=spec.get("ranking_threshold"))
        decoders[name] = RequestDecoder(decode, prompts[tok_dir])
    return decoders


def _eval_outputs(rows: dict[str, dict[str, float]], name: str) -> dict[str, str]:
    return {f"{name}_{split}": f"{name}_{split}.json" for split in rows}


# --------------------------------------------------------------------------- eval
def run_eval(
    cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, traces: StageOutput, sft: StageOutput, **_
) -> StageOutput:
    """Baselines and the AR model on valid/test: ranking, structural metrics, tokens/s and, with
    the rule teacher, how faithfully the model writes the teacher's trace."""
    from dgr2.eval.baselines import baseline_metrics
    from dgr2.eval.report import write_results_table

    key = _key("eval", cfg, ("eval",), [data, vocab, traces, sft])

    def build(work: Path) -> dict[str, Any]:
        counts = item_counts(data)
        teacher = _rule_teacher(traces, vocab)
        ar_rows = evaluate_model(cfg, data, vocab, sft.file("model"), sft.file("tokenizer"), "ar", "ar_sft", work,
                                 fidelity_teacher=teacher)
        outputs, summary = {}, {}
        for split in cfg.eval.splits:
            examples = load_split(data, split)
            rows = {name: {k: v for k, v in m.items() if k != "ndcg@1"}
                    for name, m in baseline_metrics(examples, counts, seed=cfg.data.seed).items()}
            rows["ar_sft"] = ar_rows[split]
            files = write_results_table(rows, work, f"Amazon Beauty {split} (n={len(examples)})", stem=f"results_{split}")
            outputs.update({f"{split}_{kind}": str(p.relative_to(work)) for kind, p in files.items()})
            summary[split] = rows
        stats: dict[str, Any] = {"tables": summary}
        if teacher is not None:
            stats["trace_fidelity"] = {
                split: json.loads((work / f"ar_sft_{split}.json").read_text())["trace_fidelity"] for split in ar_rows
            }
        return {"outputs": outputs, "stats": stats}

    return store.run("eval", key, build)


# --------------------------------------------------------------------------- block diffusion stages
def _write_diffusion_meta(model_dir: Path, cfg: Config, tokenizer_dir: Path) -> None:
    """Mark a HF checkpoint as a block-diffusion model (mask id, block size, schedule)."""
    from dgr2.models.block_diffusion import META_FILE, mask_id_from_tokenizer
    from dgr2.tokenizer.hf import load_tokenizer

    d = cfg.diffusion
    meta = {"mask_id": mask_id_from_tokenizer(load_tokenizer(tokenizer_dir)), "block_size": d.block_size,
            "mask_schedule": d.mask_schedule, "mask_eps": d.mask_eps, "loss_weighting": d.loss_weighting,
            "suffix_mask_prob": d.suffix_mask_prob}
    (Path(model_dir) / META_FILE).write_text(json.dumps(meta, indent=2))


def _diffusion_extra(cfg: Config, tokenizer_dir: Path) -> dict[str, Any]:
    from dgr2.eval.model_eval import stop_token_ids
    from dgr2.models.block_diffusion import mask_id_from_tokenizer
    from dgr2.tokenizer.hf import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    return {"mask_id": mask_id_from_tokenizer(tok), "pad_id": tok.pad_token_id,
            "diffusion": cfg.diffusion.model_dump(mode="json"), "stop_ids": stop_token_ids(tok)}


def _train_stage(
    stage: str, cfg: Config, train_cfg, work: Path, *, loss: str, data_path: Path, init: StageOutput,
    tokenizer_dir: Path, extra: dict[str, Any], loop: str, mlflow_uri: str | None, mlflow_run_id: str | None,
) -> dict[str, Any]:
    """Run one training stage from ``init``'s model, write model/ (+ diffusion meta) and history."""
    from dgr2.config import TrainConfig
    from dgr2.train.harness import StageJob, run_stage

    train = {k: v for k, v in train_cfg.model_dump(mode="json").items() if k in TrainConfig.model_fields}
    job = StageJob(
        stage=stage, loss=loss, train=train, model=cfg.model.model_dump(mode="json"),
        tokenizer_dir=str(tokenizer_dir), data_path=str(data_path), storage_dir=str(work / "ray_train"),
        init_model_dir=str(init.file("model")), mlflow_uri=mlflow_uri, mlflow_run_id=mlflow_run_id,
        extra=extra, loop=loop,
    )
    result = run_stage(job)
    shutil.copytree(result.model_dir, work / "model")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    _write_diffusion_meta(work / "model", cfg, work / "tokenizer")
    history = result.metrics.pop("history", [])
    (work / "history.json").write_text(json.dumps(history, indent=1))
    return {k: v for k, v in result.metrics.items() if isinstance(v, (int, float, str))}


def run_naive(cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, sft: StageOutput, **_) -> StageOutput:
    """Naive conversion: the AR SFT weights decoded as a block-diffusion model, no training."""
    key = _key("naive", cfg, ("eval", "diffusion"), [data, vocab, sft])

    def build(work: Path) -> dict[str, Any]:
        shutil.copytree(sft.file("model"), work / "model")
        shutil.copytree(sft.file("tokenizer"), work / "tokenizer")
        _write_diffusion_meta(work / "model", cfg, work / "tokenizer")
        rows = evaluate_model(cfg, data, vocab, work / "model", work / "tokenizer", "diffusion", "naive", work)
        return {"outputs": {"model": "model", "tokenizer": "tokenizer", **_eval_outputs(rows, "naive")},
                "stats": {"eval": rows}}

    return store.run("naive", key, build)


def _prompt_rows(cfg: Config, data: StageOutput, vocab: StageOutput, tokenizer_dir: Path, split: str = "train") -> list[dict[str, Any]]:
    from dgr2.eval.model_eval import encode_prompts
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import load_tokenizer

    examples = [ex for ex in load_split(data, split) if ex["target_index"] >= 0]
    ids = encode_prompts(load_tokenizer(tokenizer_dir), ItemCatalog.load(vocab.file("catalog")), examples)
    return [{"example_id": ex["example_id"], "prompt_ids": p, "num_candidates": len(ex["candidates"]),
             "target_index": ex["target_index"]} for ex, p in zip(examples, ids)]


def _cft_loss_stage(
    stage: str, cfg: Config, train_cfg, work: Path, data: StageOutput, vocab: StageOutput, sft: StageOutput,
    data_path: Path, mlflow_uri: str | None, mlflow_run_id: str | None,
) -> dict[str, Any]:
    """Train the SFT model with the block-diffusion ("cft") loss on ``data_path``, then evaluate it
    as a diffusion model: the body shared by the generic-MDM baseline and CFT."""
    from dgr2.tokenizer.hf import load_tokenizer
    from dgr2.train.focus import focus_token_id

    tokenizer_dir = sft.file("tokenizer")
    extra = _diffusion_extra(cfg, tokenizer_dir)
    if train_cfg.focus_weight != 1.0:
        extra.update(focus_token_id=focus_token_id(load_tokenizer(tokenizer_dir), train_cfg.focus_token, "cft.focus_token"),
                     focus_weight=train_cfg.focus_weight)
    stats = _train_stage(stage, cfg, train_cfg, work, loss="cft", data_path=data_path, init=sft,
                         tokenizer_dir=tokenizer_dir, extra=extra, loop="offline",
                         mlflow_uri=mlflow_uri, mlflow_run_id=mlflow_run_id)
    evals = evaluate_model(cfg, data, vocab, work / "model", work / "tokenizer", "diffusion", stage, work)
    return {"outputs": {"model": "model", "tokenizer": "tokenizer", "history": "history.json", **_eval_outputs(evals, stage)},
            "stats": {**stats, "eval": evals}}


def run_mdm(
    cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, sft: StageOutput,
    mlflow_uri: str | None = None, mlflow_run_id: str | None = None, **_,
) -> StageOutput:
    """Generic masked-denoising fine-tuning: the CFT loss on prompt text only (no traces, no
    answers) - the conversion adapts to bidirectional blocks without learning the output structure."""
    from dgr2.train.batches import write_tokenized

    train_cfg = _mdm_train_cfg(cfg)
    key = _key("mdm", cfg, ("model", "diffusion", "eval"), [data, vocab, sft], replace={"cft": _cft_section(train_cfg)})

    def build(work: Path) -> dict[str, Any]:
        import pyarrow as pa

        tokenizer_dir = sft.file("tokenizer")
        rows = _prompt_rows(cfg, data, vocab, tokenizer_dir)
        table = pa.table({"input_ids": pa.array([r["prompt_ids"] for r in rows], type=pa.list_(pa.int32())),
                          "prompt_len": pa.array([1] * len(rows), type=pa.int32())})  # "<s>" is the prompt
        write_tokenized(table, work / "generic_tokens.parquet")
        manifest = _cft_loss_stage("mdm", cfg, train_cfg, work, data, vocab, sft, work / "generic_tokens.parquet",
                                   mlflow_uri, mlflow_run_id)
        (work / "generic_tokens.parquet").unlink()
        return manifest

    return store.run("mdm", key, build)


def run_cft(
    cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, traces: StageOutput, sft: StageOutput,
    mlflow_uri: str | None = None, mlflow_run_id: str | None = None, **_,
) -> StageOutput:
    """Conversion fine-tuning: the block-diffusion loss on the teacher trajectories (trace + answer)."""
    key = _key("cft", cfg, ("model", "diffusion", "eval"), [data, vocab, traces, sft],
               replace={"cft": _cft_section(cfg.cft)})

    def build(work: Path) -> dict[str, Any]:
        return _cft_loss_stage("cft", cfg, cfg.cft, work, data, vocab, sft, traces.file("tokens"), mlflow_uri, mlflow_run_id)

    return store.run("cft", key, build)


def _online_stage(
    stage: str, cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, init: StageOutput,
    extra_inputs: list[StageOutput], sections: tuple[str, ...], train_cfg, extra: dict[str, Any],
    mlflow_uri: str | None, mlflow_run_id: str | None, eval_kind: str = "diffusion", loss: str | None = None,
) -> StageOutput:
    import pyarrow as pa
    import pyarrow.parquet as pq

    key = _key(stage, cfg, ("model", "diffusion", "rollout", "eval", *sections), [data, vocab, init, *extra_inputs])

    def build(work: Path) -> dict[str, Any]:
        tokenizer_dir = init.file("tokenizer")
        rows = _prompt_rows(cfg, data, vocab, tokenizer_dir)
        pq.write_table(pa.Table.from_pylist(rows), work / "prompts.parquet")
        full_extra = {**_diffusion_extra(cfg, tokenizer_dir), "rollout": cfg.rollout.model_dump(mode="json"),
                      "prompts_per_step": train_cfg.prompts_per_step, **extra}
        stats = _train_stage(stage, cfg, train_cfg, work, loss=loss or stage, data_path=work / "prompts.parquet", init=init,
                             tokenizer_dir=tokenizer_dir, extra=full_extra, loop="online",
                             mlflow_uri=mlflow_uri, mlflow_run_id=mlflow_run_id)
        (work / "prompts.parquet").unlink()
        _plot_history(work / "history.json", work / f"{stage}_curves.png", stage)
        evals = evaluate_model(cfg, data, vocab, work / "model", work / "tokenizer", eval_kind, stage, work)
        return {"outputs": {"model": "model", "tokenizer": "tokenizer", "history": "history.json",
                            "curves": f"{stage}_curves.png", **_eval_outputs(evals, stage)},
                "stats": {**stats, "eval": evals}}

    return store.run(stage, key, build)


def run_opd(
    cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, sft: StageOutput, cft: StageOutput,
    mlflow_uri: str | None = None, mlflow_run_id: str | None = None, **_,
) -> StageOutput:
    """On-policy distillation: CFT student rollouts on Ray actors, the frozen AR SFT model as teacher."""
    o = cfg.opd
    extra = {"kind": "opd", "teacher_dir": str(sft.file("model")), "samples_per_prompt": o.rollouts_per_prompt,
             "opd": {"divergence": o.divergence, "jsd_beta": o.jsd_beta, "teacher_top_k": o.teacher_top_k,
                     "student_mask": o.student_mask, "focus_token": o.focus_token, "focus_weight": o.focus_weight,
                     "clean_weight": o.clean_weight}}
    return _online_stage("opd", cfg, store, data, vocab, cft, [sft], ("opd",), o, extra, mlflow_uri, mlflow_run_id)


def _rl_extra(cfg: Config) -> dict[str, Any]:
    from dgr2.eval.reward import reward_config_of

    r = cfg.rl
    return {"kind": "rl", "samples_per_prompt": r.group_size, "drop_zero_advantage": r.drop_zero_advantage,
            "rl": {"clip_low": r.clip_eps, "clip_high": r.clip_eps_high, "temperature": cfg.rollout.temperature,
                   "replay_steps": r.replay_steps},
            "reward": asdict(reward_config_of(r))}


def run_rl(
    cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, opd: StageOutput,
    mlflow_uri: str | None = None, mlflow_run_id: str | None = None, **_,
) -> StageOutput:
    """GRPO on the re-ranking reward, starting from the OPD student."""
    r, extra = cfg.rl, _rl_extra(cfg)
    return _online_stage("rl", cfg, store, data, vocab, opd, [], ("rl",), r, extra, mlflow_uri, mlflow_run_id)


def run_ar_rl(
    cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, sft: StageOutput,
    mlflow_uri: str | None = None, mlflow_run_id: str | None = None, **_,
) -> StageOutput:
    """GRPO on the AR model (the GR2 stage), so AR and diffusion are compared after equal recipes.

    The same online loop, with block size 1: a block-diffusion model with one-token blocks *is*
    the AR model (same logits, tested), its rollouts are AR sampling and its replay is the exact
    AR log-probability.  Evaluated with the AR decoder.
    """
    ar_cfg = cfg.model_copy(update={"diffusion": cfg.diffusion.model_copy(update={"block_size": 1, "max_steps_per_block": 1})})
    r, extra = cfg.rl, _rl_extra(cfg)
    return _online_stage("ar_rl", ar_cfg, store, data, vocab, sft, [], ("rl",), r, extra, mlflow_uri, mlflow_run_id,
                         eval_kind="ar", loss="rl")


def _plot_history(history_path: Path, out: Path, stage: str) -> None:
    """Per-step curves of an online stage (reward, divergence/loss, validity) as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = json.loads(history_path.read_text())
    if not history:
        return
    panels = [("rollout/reward_mean", "reward (rollouts)"), ("train/divergence", "divergence to teacher"),
              ("train/loss", "loss"), ("rollout/valid_rate", "valid rate (rollouts, T>0)")]
    panels = [(k, t) for k, t in panels if any(k in h for h in history)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (k, title) in zip(list(axes) if len(panels) > 1 else [axes], panels):
        steps = [h["step"] for h in history if k in h]
        ax.plot(steps, [h[k] for h in history if k in h], marker=".")
        ax.set_title(f"{stage}: {title}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- report
REPORT_ROWS = [("ar_sft", "eval"), ("ar_sft_rl", "ar_rl"), ("naive", "naive"), ("mdm", "mdm"), ("cft", "cft"), ("opd", "opd"), ("rl", "rl")]


def run_report(
    cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, sft: StageOutput, evals: StageOutput,
    ar_rl: StageOutput | None, naive: StageOutput, mdm: StageOutput | None, cft: StageOutput, opd: StageOutput,
    rl: StageOutput, **_,
) -> StageOutput:
    """The recipe's table (baselines, AR, every diffusion stage), the tau speed/accuracy sweep of
    the final model next to the AR model, and the stage curves.  ``ar_rl`` and ``mdm`` are None
    when ``pipeline.ablations`` leaves them out; their rows are then absent."""
    from dgr2.eval.report import write_results_table

    stages = {"eval": evals, "ar_rl": ar_rl, "naive": naive, "mdm": mdm, "cft": cft, "opd": opd, "rl": rl}
    stages = {k: v for k, v in stages.items() if v is not None}
    key = _key("report", cfg, ("eval", "diffusion"), [data, vocab, sft, *stages.values()])

    def build(work: Path) -> dict[str, Any]:
        outputs: dict[str, str] = {}
        tables: dict[str, Any] = {}
        gap_tables: dict[str, Any] = {}
        for split in cfg.eval.splits:
            base = evals.manifest["stats"]["tables"][split]
            rows = {k: v for k, v in base.items() if k != "ar_sft"}
            for name, source in REPORT_ROWS:
                if source not in stages:
                    continue
                out = stages[source]
                rows[name] = base["ar_sft"] if source == "eval" else out.manifest["stats"]["eval"][split]
            files = write_results_table(rows, work, f"Diffusion-GR2 recipe, Amazon Beauty {split}", stem=f"recipe_{split}")
            outputs.update({f"{split}_{kind}": str(p.relative_to(work)) for kind, p in files.items()})
            tables[split] = rows
            gaps = _gaps_to_ar(cfg, data, stages, split)
            if gaps:
                files = write_results_table(gaps, work, f"NDCG@10 gap to AR SFT on the same {split} users",
                                            stem=f"recipe_{split}_gaps")
                outputs.update({f"{split}_gaps_{kind}": str(p.relative_to(work)) for kind, p in files.items()})
                gap_tables[split] = gaps
        sweep = _tau_sweep(cfg, data, vocab, sft, rl, work)
        outputs.update(sweep["outputs"])
        return {"outputs": outputs, "stats": {"tables": tables, "gaps_to_ar": gap_tables, "tau_sweep": sweep["rows"]}}

    return store.run("report", key, build)


def _gaps_to_ar(
    cfg: Config, data: StageOutput, stages: dict[str, StageOutput], split: str
) -> dict[str, dict[str, float]]:
    """Each report row's NDCG@10 minus the AR SFT model's over the same users, with the paired
    standard error, and its valid rate with the binomial one (:mod:`dgr2.eval.paired`): at 300
    users a split a 1% gap is below the error of an unpaired comparison.  Built from the
    completions each stage's evaluation wrote; a stage without them (cached by older code) is
    left out, and no table is made without the AR model's."""
    from dgr2.eval.paired import gaps_against, score_saved_completions
    from dgr2.eval.reward import reward_config_of

    examples = load_split(data, split)
    scored = {}
    for name, source in REPORT_ROWS:
        if source not in stages:
            continue
        path = completions_file(stages[source].path, "ar_sft" if source == "eval" else source, split)
        if path.is_file():
            scored[name] = score_saved_completions(path, examples)
        else:
            log.warning("report: %s has no %s; its row is left out of the gap table", source, path.name)
    return gaps_against(scored, "ar_sft", reward_config_of(cfg.rl)) if "ar_sft" in scored else {}


COMMIT_ORDER_TAGS = {"confidence": "conf", "left_to_right": "l2r"}


def _tau_sweep(cfg: Config, data: StageOutput, vocab: StageOutput, sft: StageOutput, final: StageOutput, work: Path,
               label: str = "rl") -> dict[str, Any]:
    """Accuracy and tokens/s of the final diffusion model (rows ``<label>_...``) over thresholds
    and commit orders, then over decode block sizes at the configured rule; AR measured alongside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dgr2.eval.report import write_results_table

    split = cfg.eval.tau_sweep_split
    sweep_dir = work / "tau_sweep"
    sweep_dir.mkdir()
    rows = {"ar_sft": evaluate_model(cfg, data, vocab, sft.file("model"), sft.file("tokenizer"), "ar", "ar", sweep_dir, [split])[split]}
    model, tokenizer = final.file("model"), final.file("tokenizer")
    specs: dict[str, dict[str, Any]] = {"ar_sft": {"model_dir": sft.file("model"), "tokenizer_dir": sft.file("tokenizer"), "kind": "ar"}}
    orders = cfg.eval.commit_order_sweep or [cfg.diffusion.commit_order]
    for order in orders:
        for tau in cfg.eval.tau_sweep:
            name = f"{label}_tau{tau:g}" if len(orders) == 1 else f"{label}_{COMMIT_ORDER_TAGS[order]}_tau{tau:g}"
            specs[name] = {"model_dir": model, "tokenizer_dir": tokenizer, "kind": "diffusion", "threshold": tau,
                           "commit_order": order}
    for block in cfg.eval.decode_block_sweep:  # the configured rule, the trained block cut smaller
        specs[f"{label}_block{block}"] = {"model_dir": model, "tokenizer_dir": tokenizer, "kind": "diffusion",
                                          "block_size": block}
    ranking = cfg.diffusion.ranking_threshold
    for tau in cfg.eval.tau_sweep if ranking is not None else []:  # the configured order, stricter ranking sections
        if tau < ranking:
            specs[f"{label}_tau{tau:g}_rank{ranking:g}"] = {
                "model_dir": model, "tokenizer_dir": tokenizer, "kind": "diffusion", "threshold": tau,
                "ranking_threshold": ranking}
    for name, spec in specs.items():
        if name != "ar_sft":
            rows[name] = evaluate_model(cfg, data, vocab, model, tokenizer, "diffusion", name, sweep_dir, [split],
                                        threshold=spec.get("threshold"), commit_order=spec.get("commit_order"),
                                        block_size=spec.get("block_size"),
                                        ranking_threshold=spec.get("ranking_threshold"))[split]
    if cfg.eval.latency_examples:  # every row one request at a time, interleaved request by request
        from dgr2.eval.latency import interleaved_request_speed

        log.info("timing %d rows one request at a time on %d prompts, interleaved", len(specs), cfg.eval.latency_examples)
        for name, speed in interleaved_request_speed(_request_decoders(cfg, data, vocab, split, specs)).items():
            rows[name].update(speed)
    ar = rows["ar_sft"]
    for row in rows.values():
        row["speedup_vs_ar"] = row["tokens_per_s"] / max(ar["tokens_per_s"], 1e-9)
        if cfg.eval.latency_examples:
            row["speedup_vs_ar_b1"] = row["tokens_per_s_b1"] / max(ar["tokens_per_s_b1"], 1e-9)
    files = write_results_table(rows, work, f"Final model over decoding threshold tau ({split})", stem="tau_sweep")
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, row in rows.items():
        ax.scatter(row["tokens_per_s"], row["ndcg@10"], label=name, s=40 if name == "ar_sft" else 25)
        ax.annotate(name.replace(f"{label}_", ""), (row["tokens_per_s"], row["ndcg@10"]), fontsize=8)
    ax.set_xlabel("decode tokens/s (same machine, same prompts)")
    ax.set_ylabel(f"NDCG@10 ({split}, strict)")
    ax.set_title("speed / accuracy over tau")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(work / "tau_sweep_curve.png", dpi=110)
    plt.close(fig)
    outputs = {f"tau_{kind}": str(p.relative_to(work)) for kind, p in files.items()}
    outputs["tau_curve"] = "tau_sweep_curve.png"
    return {"outputs": outputs, "rows": rows}


# --------------------------------------------------------------------------- register
def run_register(
    cfg: Config, store: StageStore, vocab: StageOutput, sft: StageOutput, rl: StageOutput, report: StageOutput,
    mlflow_uri: str | None = None, mlflow_run_id: str | None = None, **_,
) -> StageOutput:
    """Package the final model as a serving bundle and register it in the MLflow Model Registry
    (``models:/<name>/<version>``) with its test metrics; the AR SFT model rides along for the
    Serve comparison route."""
    from dgr2.registry import register_bundle
    from dgr2.serving.bundle import save_bundle

    key = _key("register", cfg, ("serve_model",), [vocab, sft, rl, report])

    def build(work: Path) -> dict[str, Any]:
        split = cfg.eval.tau_sweep_split
        metrics = {k: float(v) for k, v in report.manifest["stats"]["tables"][split]["rl"].items()
                   if isinstance(v, (int, float))}
        d = cfg.diffusion
        bundle = save_bundle(
            work / "bundle", rl.file("model"), rl.file("tokenizer"), vocab.file("catalog"),
            name=cfg.serve_model.name, version=rl.key, kind="diffusion",
            decoding={"max_steps_per_block": d.max_steps_per_block, "threshold": d.confidence_threshold,
                      "max_new_tokens": cfg.eval.max_new_tokens, "commit_order": d.commit_order,
                      "defer_repeats": d.defer_repeats, "head_chunk": d.head_chunk,
                      "ranking_threshold": d.ranking_threshold, "ranking_marker": d.ranking_marker},
            # block: block_diffusion.json
            mlflow_run_id=mlflow_run_id, metrics=metrics, ar_model_dir=sft.file("model"),
        )
        stats: dict[str, Any] = {"metrics": metrics}
        if mlflow_uri and mlflow_run_id:
            version = register_bundle(mlflow_uri, mlflow_run_id, bundle, metrics, name=cfg.serve_model.name)
            stats.update(registered_name=cfg.serve_model.name, registered_version=int(version),
                         model_uri=f"models:/{cfg.serve_model.name}/{version}")
        return {"outputs": {"bundle": str(bundle.relative_to(work))}, "stats": stats}

    return store.run("register", key, build)


STAGE_FUNCTIONS = {
    "data": run_data, "vocab": run_vocab, "traces": run_traces, "sft": run_sft, "eval": run_eval, "ar_rl": run_ar_rl,
    "naive": run_naive, "mdm": run_mdm, "cft": run_cft, "opd": run_opd, "rl": run_rl, "report": run_report, "register": run_register,
}


OPTIONAL_STAGES: tuple[str, ...] = get_args(OptionalStage)  # comparison rows, switched by ``pipeline.ablations``


def switched_off(ablations: list[str] | tuple[str, ...]) -> set[str]:
    """The optional comparison stages that ``pipeline.ablations`` leaves out."""
    return set(OPTIONAL_STAGES) - set(ablations)


def closure(stages: list[str], ablations: list[str] | tuple[str, ...] = OPTIONAL_STAGES) -> list[str]:
    """The stages to resolve for ``stages``: them plus everything they read, in pipeline order;
    an optional comparison stage not in ``ablations`` is left out (its readers get None)."""
    off = switched_off(ablations)
    needed: set[str] = set()
    todo = list(stages)
    while todo:
        name = todo.pop()
        if name not in STAGE_INPUTS:
            raise KeyError(f"unknown stage {name!r}; stages are {STAGE_ORDER}")
        if name not in needed and name not in off:
            needed.add(name)
            todo.extend(STAGE_INPUTS[name])
    return [s for s in STAGE_ORDER if s in needed]
