"""Why a diffusion stage's rankings are invalid: counts by kind, then a probe of each duplicate.

Almost every invalid ranking of the CFT/OPD/RL models is a candidate label written twice in a
row (``... c5 c5 ...``).  Two decoding histories can produce that token:

* **sequential**: the model, reading the committed prefix up to the first copy, predicts the
  label again - an error an AR decoder could make too;
* **parallel**: the second copy was committed in the same pass as the first, while the slot
  before it was still ``[MASK]`` - the model's prediction for a slot whose left neighbour is
  unknown, taken as confident.

For the first adjacent repeat ``j`` of every invalid completion this script scores slot ``j``
in the two states of its block: left context committed up to ``j - 1`` (``p_seq``) and with
slot ``j - 1`` masked too (``p_par``), the rest of the block masked in both.  ``p_par >= tau``
with a low ``p_seq`` means the duplicate came from parallel commitment, not from the model's
belief given its own prefix.

    .venv/bin/python benchmarks/failure_modes.py --config beauty --stage runs/stages/cft/<key> \\
        --split test --out benchmarks/results/<name>
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.stage_cli import stage_context, stage_parser  # noqa: E402
from dgr2.pipeline import load_split  # noqa: E402


def first_adjacent_repeat(tokens: list[str]) -> int | None:
    """Index of the second of the first two equal adjacent candidate labels (``c<digits>``)."""
    for i in range(1, len(tokens)):
        t = tokens[i]
        if t == tokens[i - 1] and t.startswith("c") and t[1:].isdigit():
            return i
    return None


def main(argv: list[str] | None = None) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from tqdm import tqdm

    from dgr2.eval.model_eval import encode_prompts
    from dgr2.eval.parse import parse_completion
    from dgr2.models.ar import load_model
    from dgr2.models.block_diffusion import BlockDiffusionLM, DiffusionBatch, mask_id_from_tokenizer
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import load_tokenizer

    p = stage_parser(__doc__)
    p.add_argument("--split", default="test")
    args = p.parse_args(argv)
    ctx = stage_context(args)
    cfg, data, vocab, stage = ctx.cfg, ctx.data, ctx.vocab, ctx.stage
    found = sorted(stage.glob(f"completions_*_{args.split}.jsonl"))
    if not found:
        raise SystemExit(f"{stage} has no completions_*_{args.split}.jsonl (is it a completed diffusion stage?)")
    completions = [json.loads(line) for line in found[0].read_text().splitlines() if line.strip()]
    examples = {ex["example_id"]: ex for ex in load_split(data, args.split)}
    unknown = [row["example_id"] for row in completions if row["example_id"] not in examples]
    if unknown:
        raise SystemExit(f"{len(unknown)} completions in {found[0].name} (e.g. {unknown[0]!r}) are not in the "
                         f"{args.split} split of --config {args.config}: pass the profile the stage was built with")
    tokenizer = load_tokenizer(stage / "tokenizer")
    model = load_model(stage / "model").eval()
    block = cfg.diffusion.block_size
    lm = BlockDiffusionLM(model, mask_id=mask_id_from_tokenizer(tokenizer), block_size=block)
    catalog = ItemCatalog.load(vocab.file("catalog"))
    tau = cfg.diffusion.confidence_threshold

    kinds: Counter[str] = Counter()
    probes: list[dict[str, float]] = []
    for row in tqdm(completions, desc="probe"):
        ex = examples[row["example_id"]]
        parsed = parse_completion(row["completion"], len(ex["candidates"]))
        if parsed.valid:
            kinds["valid"] += 1
            continue
        kinds["format_error" if parsed.format_error else "duplicate" if parsed.duplicates else
              "out_of_set" if parsed.out_of_set else "missing"] += 1
        ids = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        j = first_adjacent_repeat(tokenizer.convert_ids_to_tokens(ids))
        if j is None:
            kinds["invalid_without_adjacent_repeat"] += 1
            continue
        batch = DiffusionBatch.collate([encode_prompts(tokenizer, catalog, [ex])[0]], [ids], tokenizer.pad_token_id)
        end = min((j // block + 1) * block, batch.completion_ids.shape[1])
        seq, par = batch.completion_ids.clone(), batch.completion_ids.clone()
        seq[0, j:end] = lm.mask_id
        par[0, j - 1:end] = lm.mask_id
        with torch.no_grad():
            p_seq = float(lm.shifted_logits(batch, seq)[0, j].float().softmax(-1)[ids[j]])
            p_par = float(lm.shifted_logits(batch, par)[0, j].float().softmax(-1)[ids[j]])
        probes.append({"p_seq": p_seq, "p_par": p_par, "slot_in_block": j % block})

    n_probe = max(len(probes), 1)
    parallel = sum(1 for r in probes if r["p_par"] >= tau and r["p_seq"] < 0.5)
    summary = {
        "stage": str(stage), "split": args.split, "examples": len(completions), "tau": tau,
        "kinds": dict(kinds), "probed_repeats": len(probes),
        "mean_p_seq": sum(r["p_seq"] for r in probes) / n_probe,
        "mean_p_par": sum(r["p_par"] for r in probes) / n_probe,
        "parallel_commit_share": parallel / n_probe,
        "sequential_share": sum(1 for r in probes if r["p_seq"] >= 0.5) / n_probe,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "failure_modes.json").write_text(json.dumps({**summary, "probes": probes}, indent=1))
    lines = ["| quantity | value |", "|---|---:|"] + [
        f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |"
        for k, v in summary.items() if k not in ("stage", "kinds")
    ] + [f"| invalid: {k} | {v} |" for k, v in sorted(kinds.items())]
    (args.out / "failure_modes.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(4.5, 4.2))
    ax.scatter([r["p_seq"] for r in probes], [r["p_par"] for r in probes], s=14, alpha=0.7)
    ax.axhline(tau, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("p(repeat | left neighbour committed)")
    ax.set_ylabel("p(repeat | left neighbour masked)")
    ax.set_title(f"first repeated label of each invalid ranking (n={len(probes)})")
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    fig.tight_layout()
    fig.savefig(args.out / "failure_modes.png", dpi=110)
    plt.close(fig)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
