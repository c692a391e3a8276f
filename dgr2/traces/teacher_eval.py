"""How good is the teacher the AR model will imitate?  Compare it with the baselines.

Why it matters: SFT traces can only be as good as the teacher's rankings, so the rule
teacher must clearly beat retriever order and popularity on held-out (validation) examples
before traces are worth training on.  ``python -m dgr2.traces.teacher_eval`` prepares the
default data, fits the rule teacher on train and prints validation metrics plus the
rejection-sampling acceptance rate on train.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dgr2.eval.baselines import baseline_metrics
from dgr2.eval.examples import example_target
from dgr2.eval.metrics import ranking_metrics
from dgr2.traces.teacher import RankingTeacher, RerankRequest


def teacher_vs_baselines(
    teacher: RankingTeacher,
    examples: Sequence[Mapping[str, Any]],
    item_counts: Mapping[Hashable, int],
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """``{name: metrics}`` for the teacher's noise-free ranking and every eval baseline."""
    targets = [example_target(ex, i) for i, ex in enumerate(examples)]
    rankings = [teacher.rank(RerankRequest.from_example(ex)).ranking for ex in examples]
    return {f"teacher_{teacher.name}": ranking_metrics(rankings, targets), **baseline_metrics(examples, item_counts, seed)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from dgr2.config import DataConfig, SidConfig, TraceConfig
    from dgr2.data.loader import load_raw_dataset
    from dgr2.data.prepare import prepare_examples
    from dgr2.tokenizer.catalog import ItemCatalog
    from dgr2.tokenizer.sid import build_semantic_ids
    from dgr2.traces.rejection import rejection_sample
    from dgr2.traces.rule_teacher import RuleTeacher

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/teacher_eval"), help="prepared-data cache root")
    parser.add_argument("--valid", type=int, default=5000, help="validation examples to score")
    parser.add_argument("--rejection", type=int, default=5000, help="train examples to rejection-sample")
    args = parser.parse_args(argv)

    data_cfg, trace_cfg = DataConfig(), TraceConfig()
    prepared = prepare_examples(data_cfg, args.out)
    raw = load_raw_dataset(Path(data_cfg.path))
    stats = prepared.load_item_stats()
    buckets = dict(zip(stats.column("item_id").to_pylist(), stats.column("pop_bucket").to_pylist()))
    catalog = ItemCatalog.from_buckets(build_semantic_ids(raw.keywords, SidConfig().levels), buckets)
    train = prepared.examples("train")
    teacher = RuleTeacher.fit(catalog, train, weight_noise=trace_cfg.weight_noise, max_count=trace_cfg.max_count)
    valid = prepared.examples("valid")[: args.valid]
    _, rejection = rejection_sample(
        train[: args.rejection], teacher, catalog, trace_cfg.accept_top_k, trace_cfg.samples_per_example, trace_cfg.seed
    )
    result = {
        "valid_examples": len(valid),
        "metrics": teacher_vs_baselines(teacher, valid, counts, data_cfg.seed),
        "rejection_train": rejection.to_dict(),
        "teacher_fit": teacher.fit_report,
    }
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
