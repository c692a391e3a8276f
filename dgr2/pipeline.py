"""The pipeline's stages: each takes the config plus its inputs' outputs, returns its own.

Data flows one way: files -> examples (Parquet) -> SIDs + tokenizer -> traces -> tokenized
batches -> SFT checkpoint -> evaluation.  Every stage is cached in the :class:`StageStore`
under a key that hashes the config sections it reads and its inputs' keys, so a rerun skips
finished stages and a killed one resumes in its ``.partial`` folder.  ``flows/full_pipeline.py``
only wires these together and talks to MLflow.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from dgr2.config import Config
from dgr2.stage_store import StageOutput, StageStore, stage_key

log = logging.getLogger(__name__)

# Bump a stage's version when its code changes what it writes (invalidates its cache).
STAGE_VERSIONS = {"data": "1", "vocab": "1", "traces": "1", "sft": "1", "eval": "1"}
STAGE_ORDER = ["data", "vocab", "traces", "sft", "eval"]


def _key(stage: str, cfg: Config, sections: tuple[str, ...], inputs: list[StageOutput]) -> str:
    payload = {
        "config": {s: getattr(cfg, s).model_dump(mode="json") for s in sections},
        "inputs": {o.stage: o.key for o in inputs},
    }
    return stage_key(stage, STAGE_VERSIONS[stage], payload)


# --------------------------------------------------------------------------- data
def run_data(cfg: Config, store: StageStore) -> StageOutput:
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


def item_counts(data: StageOutput) -> dict[str, int]:
    import pyarrow.parquet as pq

    table = pq.read_table(data.file("item_stats"), columns=["item_id", "train_count"])
    return dict(zip(table.column("item_id").to_pylist(), table.column("train_count").to_pylist()))


# --------------------------------------------------------------------------- vocab
def run_vocab(cfg: Config, store: StageStore, data: StageOutput) -> StageOutput:
    """Semantic IDs from keyword levels, the item catalog and the HF tokenizer."""
    from dgr2.data.loader import load_raw_dataset
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import build_tokenizer
    from dgr2.tokenizer.sid import build_semantic_ids

    key = _key("vocab", cfg, ("sid",), [data])

    def build(work: Path) -> dict[str, Any]:
        raw = load_raw_dataset(Path(cfg.data.path))
        sids = build_semantic_ids(raw.keywords, levels=cfg.sid.levels)
        catalog = ItemCatalog.from_counts(sids, item_counts(data))
        catalog.save(work / "catalog.json")
        tokenizer = build_tokenizer(sids.tokens(), work / "tokenizer")
        return {
            "outputs": {"catalog": "catalog.json", "tokenizer": "tokenizer"},
            "stats": {"sid": sids.report, "vocab_size": len(tokenizer)},
        }

    return store.run("vocab", key, build)


# --------------------------------------------------------------------------- traces
def run_traces(cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput) -> StageOutput:
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
    mlflow_uri: str | None, mlflow_run_id: str | None,
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


# --------------------------------------------------------------------------- eval
def run_eval(cfg: Config, store: StageStore, data: StageOutput, vocab: StageOutput, sft: StageOutput) -> StageOutput:
    """Baselines and the AR model on valid/test: ranking, structural metrics and tokens/s."""
    import torch

    from dgr2.decoding.ar import ar_generate
    from dgr2.eval.baselines import baseline_metrics
    from dgr2.eval.model_eval import evaluate_decoder, flat_row, stop_token_ids
    from dgr2.eval.report import write_results_table
    from dgr2.models.ar import load_model
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import load_tokenizer

    key = _key("eval", cfg, ("eval",), [data, vocab, sft])

    def build(work: Path) -> dict[str, Any]:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        catalog = ItemCatalog.load(vocab.file("catalog"))
        tokenizer = load_tokenizer(sft.file("tokenizer"))
        model = load_model(sft.file("model"))
        counts = item_counts(data)
        stops = stop_token_ids(tokenizer)

        def decode(prompt_ids):
            return ar_generate(
                model, prompt_ids, max_new_tokens=cfg.eval.max_new_tokens, eos_id=tokenizer.eos_token_id,
                pad_id=tokenizer.pad_token_id, stop_ids=stops, batch_size=cfg.eval.batch_size,
            )

        outputs, summary = {}, {}
        for split in cfg.eval.splits:
            examples = load_split(data, split)
            rows = {name: {k: v for k, v in m.items() if k != "ndcg@1"}
                    for name, m in baseline_metrics(examples, counts, seed=cfg.data.seed).items()}
            t0 = time.perf_counter()
            evaluated = evaluate_decoder(decode, tokenizer, catalog, examples)
            log.info("eval %s: %d examples decoded in %.1fs", split, len(examples), time.perf_counter() - t0)
            rows["ar_sft"] = flat_row(evaluated)
            files = write_results_table(rows, work, f"Amazon Beauty {split} (n={len(examples)})", stem=f"results_{split}")
            (work / f"completions_{split}.jsonl").write_text(
                "\n".join(json.dumps({"example_id": ex["example_id"], "completion": c})
                          for ex, c in zip(examples, evaluated.completions))
            )
            (work / f"ar_sft_{split}.json").write_text(json.dumps(
                {"eval": evaluated.result, "decode": evaluated.decode}, indent=1))
            outputs.update({f"{split}_{kind}": str(p.relative_to(work)) for kind, p in files.items()})
            summary[split] = rows
        return {"outputs": outputs, "stats": {"tables": summary}}

    return store.run("eval", key, build)
