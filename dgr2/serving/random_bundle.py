"""A random-init tiny bundle built from real catalog data: for tests, smoke runs and load tests.

It has the real item catalog, SIDs and tokenizer of a dataset folder, but its models are
randomly initialised (no training), so their outputs are garbage: every ranking it serves
comes from repair.  ``bundle.json`` says so (``name="random-init-tiny"``,
``metrics={"random_init": true}``) and so does every benchmark that uses it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from dgr2.config import DEFAULT_DATA_DIR, ModelConfig
from dgr2.serving.bundle import save_bundle

RANDOM_BUNDLE_NAME = "random-init-tiny"


def build_random_bundle(
    out_dir: str | Path,
    data_dir: str | Path = DEFAULT_DATA_DIR,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    block_size: int = 32,
    with_ar_model: bool = True,
    max_new_tokens: int = 48,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Catalog + tokenizer from ``data_dir``'s keywords, a random tiny model; returns the bundle dir."""
    from dgr2.data.loader import load_raw_dataset
    from dgr2.models.ar import build_ar_model
    from dgr2.models.block_diffusion import BlockDiffusionLM, mask_id_from_tokenizer
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.hf import build_tokenizer
    from dgr2.tokenizer.sid import build_semantic_ids

    raw = load_raw_dataset(Path(data_dir))
    sids = build_semantic_ids(raw.keywords, levels=3)
    counts: dict[str, int] = {}
    for items in raw.sequences.values():
        for item in items:
            counts[item] = counts.get(item, 0) + 1
    catalog = ItemCatalog.from_counts(sids, counts)
    with tempfile.TemporaryDirectory(prefix="dgr2-random-bundle-") as tmp:
        work = Path(tmp)
        tokenizer = build_tokenizer(sids.tokens(), work / "tokenizer")
        catalog.save(work / "catalog.json")
        cfg = ModelConfig(
            hidden_size=hidden_size, num_layers=num_layers, num_heads=2, num_kv_heads=2,
            intermediate_size=2 * hidden_size, seed=seed,
        )
        ids = dict(pad_id=tokenizer.pad_token_id, bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id)
        model = build_ar_model(cfg, vocab_size=len(tokenizer), **ids)
        BlockDiffusionLM(model, mask_id=mask_id_from_tokenizer(tokenizer), block_size=block_size).save_pretrained(work / "model")
        ar_dir = None
        if with_ar_model:
            ar_dir = work / "ar_model"
            model.save_pretrained(ar_dir, safe_serialization=True)
        return save_bundle(
            out_dir, work / "model", work / "tokenizer", work / "catalog.json",
            name=RANDOM_BUNDLE_NAME, version="0", kind="diffusion",
            decoding={"threshold": 0.9, "max_steps_per_block": 8, "max_new_tokens": max_new_tokens},
            metrics={"random_init": True}, ar_model_dir=ar_dir, overwrite=overwrite,
        )


def main(argv: list[str] | None = None) -> None:
    """``python -m dgr2.serving.random_bundle OUT_DIR [--data DIR]``: a smoke-test bundle."""
    import argparse

    p = argparse.ArgumentParser(description="build a RANDOM-INIT tiny reranker bundle (untrained; for smoke tests)")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    path = build_random_bundle(args.out_dir, args.data, overwrite=args.overwrite)
    print(f"wrote random-init bundle {path.resolve()} (untrained: every ranking it serves is repaired)")


if __name__ == "__main__":
    main()
