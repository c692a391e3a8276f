"""Where a diffusion model's ``order`` section breaks, and how sure the decoder was when it broke.

Why: almost every invalid ranking of the beauty diffusion models breaks in the trace's ``order``
section (80 of the final model's 82 in 3,000 test users), which is a bucket sort of the
``scores`` the model wrote just before it.  Whether a decoding-time remedy can help depends on
how those errors were committed.  One the step floor *forced* (the leftmost masked slot taken
with confidence below tau, as left-to-right commits do) is a guess that a revision pass could
still reconsider (low-confidence remasking, LLaDA/ReMDM).  One committed *confidently* is the
model's belief given everything left of it, and only training changes it.

For every request whose ``order`` section departs from the sort of its own written scores, this
script re-decodes the prompt with the profile's decoding rule (greedy decoding is deterministic:
the re-decoded completion must equal the saved one, and any that does not is counted as drift),
finds the first departing word, and reports that token's commit confidence, whether the floor
forced it, whether it was committed in the same pass as the slot left of it (so predicted with
that slot still masked: a higher tau would have made it wait for it), its slot in its block, and
what was expected against what was written (a level word or a label).  Writes ``order_errors_<split>_n<N>.{json,md,png}``.

    .venv/bin/python benchmarks/order_errors.py --config beauty --set 'pipeline.ablations=[]' \\
        --examples 3000 --split test --stage runs/stages/rl/<key> \\
        --completions benchmarks/results/<run>/rl_3000/completions_rl_test.jsonl --out <folder>
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stage_cli import add_users_arguments, eval_set_overrides, stage_at, stage_context, stage_parser  # noqa: E402
from dgr2.eval.paired import read_saved_completions  # noqa: E402
from dgr2.pipeline import load_split  # noqa: E402
from dgr2.traces.rule_teacher import render_order  # noqa: E402

_SCORES_THEN_ORDER = re.compile(r"; scores (.*?) ; order (.*?)(?= </think>|$)")


@dataclass(frozen=True)
class OrderBreak:
    """The first word of an ``order`` section that departs from the sort of the written scores."""

    char_offset: int  # where the departing word starts in the completion (its end, if missing)
    expected: str  # "level", "label" or "end" (the section should have ended)
    written: str  # "level", "label" or "end" (the section ended early)


def _kind(word: str | None) -> str:
    if word is None:
        return "end"
    return "level" if word.isdigit() else "label"


def first_order_break(completion: str) -> OrderBreak | None:
    """The first departure of the ``order`` section from the bucket sort of the ``scores``
    section written before it (:func:`dgr2.traces.rule_teacher.render_order`), or None when the
    two agree.  A completion without both sections, or with a malformed ``scores`` section,
    raises ``ValueError``: there is nothing to compare it with."""
    match = _SCORES_THEN_ORDER.search(completion)
    if match is None:
        raise ValueError("no '; scores ... ; order ...' sections")
    score_words = match.group(1).split()
    if len(score_words) % 2 or not all(w.isdigit() for w in score_words[1::2]):
        raise ValueError(f"malformed scores section: {match.group(1)!r}")
    expected = render_order([(score_words[i], int(score_words[i + 1])) for i in range(0, len(score_words), 2)])
    written_spans = [(m.start() + match.start(2), m.group()) for m in re.finditer(r"\S+", match.group(2))]
    written = [w for _, w in written_spans]
    for i in range(max(len(expected), len(written))):
        want = expected[i] if i < len(expected) else None
        got = written[i] if i < len(written) else None
        if want != got:
            offset = written_spans[i][0] if i < len(written_spans) else match.end(2)
            return OrderBreak(offset, _kind(want), _kind(got))
    return None


def token_index(tokenizer: Any, completion: str, char_offset: int) -> int:
    """Index, in the completion's tokens, of the token that starts at ``char_offset`` (the trace
    vocabulary has one token a word, so it is the number of tokens before that offset)."""
    return len(tokenizer(completion[:char_offset].rstrip(), add_special_tokens=False)["input_ids"])


def summarise(records: list[dict[str, Any]], threshold: float, drift: int, unparsable: int) -> dict[str, Any]:
    """Counts and confidence quantiles of the first breaks (``records`` from :func:`main`)."""
    confidences = sorted(r["confidence"] for r in records)
    quantiles = {f"q{int(q * 100)}": confidences[round(q * (len(confidences) - 1))] for q in (0.1, 0.25, 0.5, 0.75, 0.9)} \
        if confidences else {}
    return {
        "broken_order_sections": len(records),
        "forced_below_tau": sum(r["confidence"] < threshold for r in records),
        "confident": sum(r["confidence"] >= threshold for r in records),
        "confident_with_left_neighbour_masked": sum(r["confidence"] >= threshold and r["left_neighbour_masked"]
                                                    for r in records),
        "tau": threshold,
        "confidence_quantiles": quantiles,
        "kinds": dict(Counter(f"{r['expected']}->{r['written']}" for r in records)),
        "block_slots": dict(sorted(Counter(r["block_slot"] for r in records).items())),
        "redecoded_differently": drift,
        "unparsable": unparsable,
    }


def write_outputs(summary: dict[str, Any], records: list[dict[str, Any]], out: Path, stem: str) -> None:
    """JSON (summary and every break), a markdown table and a confidence histogram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"summary": summary, "breaks": records}, indent=1))
    n = summary["broken_order_sections"]
    lines = [f"# First break of the order section ({n} requests)", "",
             "| measure | value |", "|---|---:|",
             f"| committed with confidence below tau ({summary['tau']}): forced by the step floor | {summary['forced_below_tau']} |",
             f"| committed confidently (>= tau) | {summary['confident']} |",
             f"| of those, in the same pass as the slot left of it (predicted with it masked) | "
             f"{summary['confident_with_left_neighbour_masked']} |"]
    lines += [f"| confidence {k} | {v:.3f} |" for k, v in summary["confidence_quantiles"].items()]
    lines += [f"| expected -> written: {k} | {v} |" for k, v in sorted(summary["kinds"].items())]
    lines += [f"| re-decoded differently from the saved completion | {summary['redecoded_differently']} |",
              f"| without parsable scores/order sections | {summary['unparsable']} |"]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist([r["confidence"] for r in records], bins=20, range=(0, 1))
    ax.axvline(summary["tau"], color="k", linestyle="--", label=f"tau {summary['tau']}")
    ax.set_xlabel("confidence of the first departing token at commit")
    ax.set_ylabel("requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = stage_parser(__doc__)
    add_users_arguments(p)
    p.add_argument("--completions", type=Path, required=True, help="the stage's saved completions_<name>_<split>.jsonl")
    args = p.parse_args(argv)
    args.overrides = eval_set_overrides(args)

    from dgr2.eval.model_eval import encode_prompts
    from dgr2.models.ar import load_model
    from dgr2.pipeline import _decoder
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import load_tokenizer

    ctx = stage_context(args)
    stage = stage_at(ctx.stage)
    examples = load_split(ctx.data, args.split)
    saved = read_saved_completions(args.completions, examples)
    broken: list[tuple[int, OrderBreak]] = []
    unparsable = 0
    for i, completion in enumerate(saved):
        try:
            found = first_order_break(completion)
        except ValueError:
            unparsable += 1
            continue
        if found is not None:
            broken.append((i, found))
    tokenizer = load_tokenizer(stage.file("tokenizer"))
    model = load_model(stage.file("model"))
    prompts = encode_prompts(tokenizer, ItemCatalog.load(ctx.vocab.file("catalog")), [examples[i] for i, _ in broken])
    decoded = _decoder(ctx.cfg, "diffusion", model, tokenizer)(prompts) if prompts else None
    records, drift = [], 0
    for j, (i, found) in enumerate(broken):
        text = tokenizer.decode(decoded.sequences[j], skip_special_tokens=False)
        if text != saved[i]:
            drift += 1
            continue
        index = token_index(tokenizer, text, found.char_offset)
        logprobs = decoded.token_logprobs[j]
        if index >= len(logprobs):
            index = len(logprobs) - 1  # the section ran to the end of the completion
        slot = index % ctx.cfg.diffusion.block_size
        steps = decoded.unmask_steps[j]
        records.append({"example_id": examples[i]["example_id"], "token_index": index, "block_slot": slot,
                        "confidence": math.exp(logprobs[index]), "expected": found.expected, "written": found.written,
                        "left_neighbour_masked": slot > 0 and steps[index - 1] >= steps[index]})
    summary = summarise(records, ctx.cfg.diffusion.confidence_threshold, drift, unparsable)
    write_outputs(summary, records, args.out, f"order_errors_{args.split}_n{len(examples)}")
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
