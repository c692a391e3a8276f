"""Decode a model on prepared examples and score it: the evaluation every stage runs.

Why one function for AR and diffusion: the accuracy and throughput of each stage must be
measured on the same prompts with the same parser and scorer, so only the decode callable
changes between rows of the results table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dgr2.decoding.output import DecodeOutput
from dgr2.eval.scoring import score_completions
from dgr2.tokenizer.catalog import ItemCatalog
from dgr2.traces import format as fmt

DecodeFn = Callable[[Sequence[Sequence[int]]], DecodeOutput]


@dataclass
class ModelEval:
    """Scores plus decoding cost of one model on one split."""

    result: dict[str, Any]
    completions: list[str]
    decode: dict[str, float]


def encode_prompts(tokenizer, catalog: ItemCatalog, examples: Sequence[dict[str, Any]]) -> list[list[int]]:
    prompts = [catalog.prompt(ex["history"], ex["candidates"]) for ex in examples]
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer) -> list[int]:
    """Decoding stops at ``</answer>`` or end of sequence, whichever comes first."""
    return [tokenizer.convert_tokens_to_ids(fmt.ANSWER_CLOSE), tokenizer.eos_token_id]


def strict_section_ids(tokenizer, marker: str) -> list[int]:
    """The token ids that open the ranking sections (``diffusion.ranking_marker``); refused
    unless ``marker`` is one token of the vocabulary, since a marker the tokenizer splits or maps
    to ``<unk>`` would silently never open the section."""
    ids = tokenizer.convert_tokens_to_ids([marker])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise ValueError(f"diffusion.ranking_marker {marker!r} is not a token of the tokenizer's vocabulary")
    return [int(ids[0])]


def evaluate_decoder(
    decode: DecodeFn, tokenizer, catalog: ItemCatalog, examples: Sequence[dict[str, Any]]
) -> ModelEval:
    """Run ``decode`` on every example's prompt, parse strictly, score; report decode cost."""
    prompt_ids = encode_prompts(tokenizer, catalog, examples)
    out = decode(prompt_ids)
    completions = [tokenizer.decode(seq, skip_special_tokens=False) for seq in out.sequences]
    scored = score_completions(completions, examples).to_dict()
    scored.pop("per_example")
    passes = out.sequence_forward_passes or [out.forward_passes / max(len(prompt_ids), 1)]
    decode_stats = {
        "seconds": out.seconds,
        "tokens_generated": float(out.tokens_generated),
        "tokens_per_s": out.tokens_generated / max(out.seconds, 1e-9),
        "forward_passes": float(out.forward_passes),
        "mean_passes_per_sequence": sum(passes) / max(len(passes), 1),
        "mean_tokens_per_sequence": out.tokens_generated / max(len(prompt_ids), 1),
    }
    return ModelEval(scored, completions, decode_stats)


def flat_row(model_eval: ModelEval) -> dict[str, float]:
    """One results-table row: strict ranking metrics, structure, repaired NDCG, tokens/s."""
    res = model_eval.result
    row = {k: float(v) for k, v in res["metrics"].items() if k != "ndcg@1"}
    row["valid_rate"] = float(res["structural"]["valid_rate"])
    row["duplicate_rate"] = float(res["structural"]["duplicate_rate"])
    row["missing_rate"] = float(res["structural"]["missing_rate"])
    row["out_of_set_rate"] = float(res["structural"]["out_of_set_rate"])
    row["format_error_rate"] = float(res["structural"]["format_error_rate"])
    row["repaired_ndcg@10"] = float(res["repaired_metrics"]["ndcg@10"])
    row["tokens_per_s"] = float(model_eval.decode["tokens_per_s"])
    return row
