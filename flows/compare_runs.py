"""Compare pipeline runs stage by stage from MLflow: a table (Markdown + CSV) and plots (PNG).

    python flows/compare_runs.py                         # the latest 5 pipeline runs
    python flows/compare_runs.py --run-name first --run-name second --split all
    python flows/compare_runs.py --run-id 9dca5a7e... --tracking-uri sqlite:///runs/mlflow.db
    python flows/compare_runs.py --rows ar_sft,cft,rl --out runs/compare/ar-vs-diffusion

Reads the MLflow store the pipeline writes (``--tracking-uri``, else ``MLFLOW_TRACKING_URI``,
else ``sqlite:///<runs_dir>/mlflow.db``), experiment ``dgr2``.  A *pipeline run* is a parent
run (tag ``dgr2.kind=pipeline``); its stages are nested runs (tags ``dgr2.stage``,
``dgr2.cached``, ``mlflow.parentRunId``; metric ``<stage>/wall_seconds``).

Rows are (run, stage, model row, split).  Model rows are discovered from metric names alone:
any metric ``.../<split>/<row>/<metric>`` whose ``<split>`` is one of ``--splits-known``
(default valid,test) - e.g. ``eval/tables/test/ar_sft/ndcg_at_10`` (the eval stage's table),
``report/tables/test/rl/ndcg_at_10`` or ``test/rl/ndcg_at_10`` - or ``<row>/eval/<split>/<metric>``
(a stage's own evaluation: ``cft/eval/test/ndcg_at_10``), so new stages and models show up
without code changes.  A stage without such metrics gets one row with
its wall time, cached flag, run status and (training stages) last ``train/tokens_per_s``.

Outputs under ``--out`` (default ``runs/compare/``): ``comparison.md``, ``comparison.csv``,
``comparison.json``, ``accuracy_vs_throughput.png`` (NDCG@10 vs decode tokens/s per model
row), ``training_curves.png`` + ``training_curves.csv`` (the per-step ``train/*`` history of
every training stage run, from ``MlflowClient.get_metric_history``; a cached stage shows the
curves of the run that built it).  The Markdown table is also printed.

Browse the same store interactively with
``mlflow ui --backend-store-uri sqlite:///runs/mlflow.db`` (then http://127.0.0.1:5000).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RUNS_DIR = PROJECT_ROOT / "runs"
DEFAULT_EXPERIMENT = "dgr2"
KNOWN_SPLITS = ("valid", "test")
# (column header, metric name after '_at_' -> '@')
DEFAULT_COLUMNS = ("recall@1", "recall@5", "recall@10", "ndcg@5", "ndcg@10", "valid_rate", "tokens_per_s")
STAGE_ORDER_HINT = ("data", "vocab", "traces", "sft", "cft", "opd", "rl", "eval", "register")


@dataclass
class Row:
    run_name: str
    run_id: str
    stage: str
    row: str  # model row ("ar_sft", "cft", "retriever", ...) or "-" for a stage without one
    split: str
    metrics: dict[str, float] = field(default_factory=dict)
    stage_seconds: float = math.nan
    cached: bool | None = None
    train_tokens_per_s: float = math.nan
    stage_run_id: str = ""
    status: str = ""  # the stage run's MLflow status: FINISHED, FAILED, RUNNING, KILLED


# --------------------------------------------------------------------------- discovery
def normalise_metric(name: str) -> str:
    """MLflow names cannot hold '@' (the pipeline writes ``ndcg_at_10``): map back to ``ndcg@10``."""
    return re.sub(r"_at_(\d+)", r"@\1", name)


def split_rows(metrics: dict[str, float], splits: Sequence[str] = KNOWN_SPLITS,
               stage: str = "") -> dict[tuple[str, str], dict[str, float]]:
    """``{(split, row): {metric: value}}`` from the metric keys of one stage run.

    Two shapes are recognised, whatever the prefix:

    * ``.../<split>/<row>/<metric>`` - a results table (``eval/tables/test/ar_sft/ndcg_at_10``,
      ``report/tables/valid/cft/recall_at_1``, ``test/rl/ndcg_at_10``);
    * ``[<row>/]eval/<split>/<metric>`` - a stage's own evaluation (``cft/eval/test/ndcg_at_10``):
      the row is the segment before ``eval``, else the stage's name.
    """
    out: dict[tuple[str, str], dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) >= 3 and parts[-3] in splits:
            split, row = parts[-3], parts[-2]
        elif len(parts) >= 3 and parts[-3] == "eval" and parts[-2] in splits:
            split, row = parts[-2], (parts[-4] if len(parts) >= 4 else stage or "eval")
        else:
            continue
        out.setdefault((split, row), {})[normalise_metric(parts[-1])] = float(value)
    return out


def default_tracking_uri(runs_dir: Path) -> str:
    return f"sqlite:///{Path(runs_dir).resolve() / 'mlflow.db'}"


def resolve_tracking_uri(explicit: str | None, runs_dir: Path) -> str:
    """--tracking-uri, then MLFLOW_TRACKING_URI, then the pipeline's default sqlite store."""
    if explicit:
        return explicit
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    db = Path(runs_dir).resolve() / "mlflow.db"
    if not db.is_file():
        raise SystemExit(f"no MLflow store at {db}: run the pipeline first, or pass --tracking-uri / --runs-dir")
    return default_tracking_uri(runs_dir)


# --------------------------------------------------------------------------- MLflow reads
def _experiment_ids(client, names: Sequence[str]) -> list[str]:
    ids = []
    for name in names:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise SystemExit(f"experiment {name!r} not found in this tracking store")
        ids.append(exp.experiment_id)
    return ids


def _search_all(client, experiment_ids: list[str], filter_string: str, order_by: list[str] | None = None,
                max_results: int | None = None) -> list[Any]:
    from mlflow.entities import ViewType

    runs, token = [], None
    while True:
        page = client.search_runs(
            experiment_ids, filter_string=filter_string, run_view_type=ViewType.ACTIVE_ONLY,
            max_results=min(max_results or 1000, 1000), order_by=order_by or ["attributes.start_time DESC"],
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token or (max_results and len(runs) >= max_results):
            return runs[:max_results] if max_results else runs


def find_parent_runs(client, experiment_ids: list[str], run_names: Sequence[str] = (), run_ids: Sequence[str] = (),
                     last: int = 5) -> list[Any]:
    """The pipeline (parent) runs to compare, oldest first."""
    chosen: list[Any] = []
    for run_id in run_ids:
        chosen.append(client.get_run(run_id))
    for name in run_names:
        hits = _search_all(client, experiment_ids, f"attributes.run_name = '{name}' and tags.`dgr2.kind` = 'pipeline'")
        if not hits:
            raise SystemExit(f"no pipeline run named {name!r}")
        chosen.append(hits[0])  # the latest with that name
    if not run_ids and not run_names:
        chosen = _search_all(client, experiment_ids, "tags.`dgr2.kind` = 'pipeline'", max_results=last)
    seen, unique = set(), []
    for run in chosen:
        if run.info.run_id not in seen:
            seen.add(run.info.run_id)
            unique.append(run)
    return sorted(unique, key=lambda r: r.info.start_time or 0)


def stage_runs(client, experiment_ids: list[str], parent_id: str) -> list[Any]:
    runs = _search_all(client, experiment_ids, f"tags.`mlflow.parentRunId` = '{parent_id}'",
                       order_by=["attributes.start_time ASC"])
    return [r for r in runs if "dgr2.stage" in r.data.tags]


def _stage_seconds(run) -> float:
    stage = run.data.tags.get("dgr2.stage", "")
    metrics = run.data.metrics
    if f"{stage}/wall_seconds" in metrics:
        return float(metrics[f"{stage}/wall_seconds"])
    if run.info.end_time and run.info.start_time:
        return (run.info.end_time - run.info.start_time) / 1000.0
    return math.nan


def _cached(run) -> bool | None:
    value = run.data.tags.get("dgr2.cached")
    return None if value is None else value.strip().lower() == "true"


def collect_rows(client, experiment_ids: list[str], parents: Sequence[Any], splits: Sequence[str] = ("test",),
                 known_splits: Sequence[str] = KNOWN_SPLITS, rows_filter: Sequence[str] = (),
                 stages_filter: Sequence[str] = ()) -> tuple[list[Row], dict[str, list[Any]]]:
    """Table rows for every (parent run, stage run, model row, split) plus the stage runs."""
    table: list[Row] = []
    children: dict[str, list[Any]] = {}
    for parent in parents:
        name = parent.info.run_name or parent.info.run_id[:8]
        kids = stage_runs(client, experiment_ids, parent.info.run_id)
        children[parent.info.run_id] = kids
        for run in kids:
            stage = run.data.tags["dgr2.stage"]
            if stages_filter and stage not in stages_filter:
                continue
            common = dict(
                run_name=name, run_id=parent.info.run_id, stage=stage, stage_seconds=_stage_seconds(run),
                cached=_cached(run), stage_run_id=run.info.run_id, status=run.info.status,
                train_tokens_per_s=float(run.data.metrics.get("train/tokens_per_s",
                                                               run.data.metrics.get(f"{stage}/train/tokens_per_s", math.nan))),
            )
            found = split_rows(run.data.metrics, known_splits, stage)
            picked = [(s, r) for (s, r) in found if ("all" in splits or s in splits)]
            if rows_filter:
                picked = [(s, r) for (s, r) in picked if r in rows_filter]
            if not found and (not rows_filter or "-" in rows_filter or stage in rows_filter):
                table.append(Row(row="-", split="-", **common))
            for split, row in sorted(picked, key=lambda k: (known_splits.index(k[0]) if k[0] in known_splits else 99, k[1])):
                table.append(Row(row=row, split=split, metrics=found[(split, row)], **common))
    return table, children


def _history_source(client, experiment_ids: list[str], run) -> Any:
    """The run holding a stage's per-step history: itself, or (cached) the run that built it."""
    if any(k.startswith("train/") for k in run.data.metrics) or not _cached(run):
        return run
    key = run.data.tags.get("dgr2.stage_key")
    if not key:
        return run
    hits = _search_all(client, experiment_ids,
                       f"tags.`dgr2.stage_key` = '{key}' and tags.`dgr2.cached` = 'False'", max_results=1)
    return hits[0] if hits else run


def collect_curves(client, experiment_ids: list[str], parents: Sequence[Any], children: dict[str, list[Any]],
                   prefix: str = "train/") -> list[dict[str, Any]]:
    """``[{run_name, stage, metric, source_run_id, steps, values}]`` for every training stage run."""
    curves = []
    for parent in parents:
        for run in children.get(parent.info.run_id, []):
            source = _history_source(client, experiment_ids, run)
            for metric in sorted(k for k in source.data.metrics if k.startswith(prefix)):
                history = sorted(client.get_metric_history(source.info.run_id, metric), key=lambda m: (m.step, m.timestamp))
                if not history:
                    continue
                curves.append({
                    "run_name": parent.info.run_name or parent.info.run_id[:8],
                    "stage": run.data.tags["dgr2.stage"],
                    "metric": metric,
                    "source_run_id": source.info.run_id,
                    "from_cache": source.info.run_id != run.info.run_id,
                    "steps": [m.step for m in history],
                    "values": [m.value for m in history],
                })
    return curves


# --------------------------------------------------------------------------- writers
def _fmt(value: float | None, precision: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.{precision}f}"


def table_header(columns: Sequence[str]) -> list[str]:
    return ["run", "stage", "row", "split", *columns, "train_tokens_per_s", "stage_seconds", "cached", "status"]


def table_cells(row: Row, columns: Sequence[str]) -> list[Any]:
    return [row.run_name, row.stage, row.row, row.split, *(row.metrics.get(c, math.nan) for c in columns),
            row.train_tokens_per_s, row.stage_seconds, "-" if row.cached is None else str(row.cached).lower(),
            row.status or "-"]


def format_markdown(rows: Sequence[Row], columns: Sequence[str]) -> str:
    header = table_header(columns)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 4 + "---:|" * (len(header) - 6) + "---|" * 2]
    for row in rows:
        cells = table_cells(row, columns)
        text = [str(c) if not isinstance(c, float) else _fmt(c) for c in cells]
        lines.append("| " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[Row], columns: Sequence[str], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow([*table_header(columns), "run_id", "stage_run_id"])
        for row in rows:
            cells = ["" if isinstance(c, float) and math.isnan(c) else c for c in table_cells(row, columns)]
            writer.writerow([*cells, row.run_id, row.stage_run_id])


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return value


def plot_accuracy_vs_throughput(rows: Sequence[Row], path: Path, accuracy: str = "ndcg@10",
                                throughput: str = "tokens_per_s") -> int:
    """Scatter: one point per (run, stage, row, split) with both numbers; returns the count."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = [(r, r.metrics[throughput], r.metrics[accuracy]) for r in rows
              if throughput in r.metrics and accuracy in r.metrics
              and not math.isnan(r.metrics[throughput]) and not math.isnan(r.metrics[accuracy])]
    baselines = {(r.run_name, r.split, r.row): r.metrics[accuracy] for r in rows
                 if accuracy in r.metrics and throughput not in r.metrics}
    figure = Figure(figsize=(7.5, 5.0))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    markers = "osD^v<>Pp*hX"
    labels = sorted({r.row for r, _, _ in points})
    for i, label in enumerate(labels):
        mine = [(x, y, r) for r, x, y in points if r.row == label]
        axes.scatter([x for x, _, _ in mine], [y for _, y, _ in mine], marker=markers[i % len(markers)], s=60, label=label)
        for x, y, r in mine:
            axes.annotate(f"{r.run_name}/{r.stage}" + ("" if r.split in ("test", "-") else f" ({r.split})"),
                          (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for (run_name, split, row), value in sorted(baselines.items()):
        if row in {"retriever", "popularity"} and split == "test":
            axes.axhline(value, linestyle=":", linewidth=0.8, color="gray")
            axes.annotate(f"{row} ({run_name})", (0.01, value), xycoords=("axes fraction", "data"), fontsize=6, color="gray")
    if points:
        xs = [x for _, x, _ in points]
        if min(xs) > 0 and max(xs) / min(xs) > 20:
            axes.set_xscale("log")
        axes.legend(fontsize="small", title="model row")
    else:
        axes.text(0.5, 0.5, f"no rows with both {accuracy} and {throughput}", ha="center", va="center",
                  transform=axes.transAxes)
    axes.set_xlabel(f"decode throughput ({throughput})")
    axes.set_ylabel(accuracy.upper() if accuracy.startswith("ndcg") else accuracy)
    axes.set_title(f"{accuracy} vs decode throughput")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return len(points)


def plot_training_curves(curves: Sequence[dict[str, Any]], path: Path) -> int:
    """One panel per metric (train/loss, train/tokens_per_s, ...), one line per (run, stage)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = sorted({c["metric"] for c in curves}, key=lambda m: (m != "train/loss", m))
    n = max(1, len(metrics))
    cols = min(2, n)
    nrows = math.ceil(n / cols)
    figure = Figure(figsize=(6.0 * cols, 3.6 * nrows))
    FigureCanvasAgg(figure)
    if not curves:
        axes = figure.add_subplot(1, 1, 1)
        axes.text(0.5, 0.5, "no training-stage metric history found", ha="center", va="center", transform=axes.transAxes)
    for i, metric in enumerate(metrics):
        axes = figure.add_subplot(nrows, cols, i + 1)
        for curve in (c for c in curves if c["metric"] == metric):
            label = f"{curve['run_name']}/{curve['stage']}" + (" (cached)" if curve["from_cache"] else "")
            axes.plot(curve["steps"], curve["values"], marker="." if len(curve["steps"]) < 30 else None,
                      linestyle="--" if curve["from_cache"] else "-", label=label)
        axes.set_title(metric)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return len(curves)


def write_curves_csv(curves: Sequence[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "stage", "metric", "step", "value", "source_run_id", "from_cache"])
        for c in curves:
            for step, value in zip(c["steps"], c["values"]):
                writer.writerow([c["run_name"], c["stage"], c["metric"], step, value, c["source_run_id"],
                                 str(c["from_cache"]).lower()])


# --------------------------------------------------------------------------- main
def _csv_list(values: Iterable[str]) -> list[str]:
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<runs-dir>/mlflow.db)")
    p.add_argument("--runs-dir", type=Path, default=DEFAULT_RUNS_DIR, help="pipeline runs_dir (for the default store)")
    p.add_argument("--experiment", action="append", default=[], help=f"experiment name (default {DEFAULT_EXPERIMENT}; repeatable)")
    p.add_argument("--run-name", action="append", default=[], help="pipeline run name (repeatable; latest run of that name)")
    p.add_argument("--run-id", action="append", default=[], help="pipeline (parent) run id (repeatable)")
    p.add_argument("--last", type=int, default=5, help="without --run-name/--run-id: the latest N pipeline runs")
    p.add_argument("--split", action="append", default=[], help="split(s) to tabulate: test (default), valid, all")
    p.add_argument("--splits-known", default=",".join(KNOWN_SPLITS), help="split names that mark <split>/<row>/<metric> keys")
    p.add_argument("--rows", action="append", default=[], help="keep only these model rows (comma list; '-' = stage-only rows)")
    p.add_argument("--stages", action="append", default=[], help="keep only these stages (comma list)")
    p.add_argument("--columns", default=",".join(DEFAULT_COLUMNS), help="metric columns (after _at_ -> @)")
    p.add_argument("--accuracy", default="ndcg@10", help="y axis of the accuracy-vs-throughput plot")
    p.add_argument("--curve-prefix", default="train/", help="metric prefix of per-step training curves")
    p.add_argument("--out", type=Path, default=None, help="output folder (default <runs-dir>/compare)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(args.tracking_uri, args.runs_dir)
    client = MlflowClient(tracking_uri=uri)
    experiment_ids = _experiment_ids(client, args.experiment or [DEFAULT_EXPERIMENT])
    parents = find_parent_runs(client, experiment_ids, args.run_name, args.run_id, args.last)
    if not parents:
        raise SystemExit(f"no pipeline runs (tag dgr2.kind=pipeline) in {uri}")
    columns = _csv_list([args.columns])
    rows, children = collect_rows(
        client, experiment_ids, parents, splits=_csv_list(args.split) or ["test"],
        known_splits=tuple(_csv_list([args.splits_known])), rows_filter=_csv_list(args.rows),
        stages_filter=_csv_list(args.stages),
    )
    curves = collect_curves(client, experiment_ids, parents, children, prefix=args.curve_prefix)

    out = Path(args.out) if args.out else Path(args.runs_dir) / "compare"
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "markdown": out / "comparison.md", "csv": out / "comparison.csv", "json": out / "comparison.json",
        "accuracy_png": out / "accuracy_vs_throughput.png", "curves_png": out / "training_curves.png",
        "curves_csv": out / "training_curves.csv",
    }
    markdown = format_markdown(rows, columns)
    title = "# dgr2 run comparison\n\n" + f"Tracking store: `{uri}`; runs: " + ", ".join(
        f"`{p.info.run_name}` ({p.info.run_id[:8]})" for p in parents) + "\n\n"
    paths["markdown"].write_text(title + markdown)
    write_csv(rows, columns, paths["csv"])
    paths["json"].write_text(json.dumps({
        "tracking_uri": uri,
        "runs": [{"name": p.info.run_name, "run_id": p.info.run_id, "tags": {k: v for k, v in p.data.tags.items()
                                                                             if k.startswith("dgr2.")}} for p in parents],
        "columns": columns,
        "rows": [_json_safe({**r.__dict__, "metrics": r.metrics}) for r in rows],
    }, indent=1) + "\n")
    n_points = plot_accuracy_vs_throughput(rows, paths["accuracy_png"], accuracy=args.accuracy)
    n_curves = plot_training_curves(curves, paths["curves_png"])
    write_curves_csv(curves, paths["curves_csv"])
    print(markdown, flush=True)
    print(f"[compare] {len(parents)} run(s), {len(rows)} row(s), {n_points} point(s), {n_curves} curve(s) -> {out}", flush=True)
    return {"rows": rows, "curves": curves, "paths": paths, "tracking_uri": uri, "parents": parents}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
