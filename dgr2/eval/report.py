"""Results tables (systems x metrics) written as JSON, Markdown, CSV and a PNG chart.

Why four formats from one call: JSON is what later stages and the benchmark diff read,
Markdown goes into the README/report, CSV into spreadsheets, and the PNG is the quick
visual check - all from the same numbers so they can never disagree.  Missing cells
(a system that lacks a metric) are NaN in memory, ``null`` in JSON, empty in CSV and
``-`` in Markdown.  Plotting uses the Agg canvas directly, so importing this module never
changes the process-wide matplotlib backend.
"""

from __future__ import annotations

import csv
import json
import math
import numbers
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

Rows = Mapping[str, Mapping[str, float]]


def table_columns(rows: Rows) -> list[str]:
    """Union of the metric names of all rows, in first-seen order."""
    columns: list[str] = []
    for metrics in rows.values():
        for name in metrics:
            if name not in columns:
                columns.append(name)
    return columns


def format_markdown_table(
    rows: Rows, columns: Sequence[str] | None = None, precision: int = 4
) -> str:
    """A GitHub Markdown table, one row per system, one column per metric."""
    _check_rows(rows)
    columns = list(columns) if columns is not None else table_columns(rows)
    lines = [
        "| system | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for system, metrics in rows.items():
        cells = [_format_cell(_cell(metrics, c), precision) for c in columns]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results_table(
    rows: Rows,
    out_dir: Path,
    title: str,
    columns: Sequence[str] | None = None,
    stem: str | None = None,
) -> dict[str, Path]:
    """Write ``<stem>.json/.md/.csv/.png`` under ``out_dir``; returns ``{format: path}``.

    ``stem`` defaults to a filesystem-safe form of ``title``.
    """
    _check_rows(rows)
    columns = list(columns) if columns is not None else table_columns(rows)
    if not columns:
        raise ValueError("a results table needs at least one metric column")
    stem = stem or _slug(title)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / f"{stem}.json",
        "markdown": out_dir / f"{stem}.md",
        "csv": out_dir / f"{stem}.csv",
        "png": out_dir / f"{stem}.png",
    }
    table = {
        system: {c: _json_value(_cell(metrics, c)) for c in columns}
        for system, metrics in rows.items()
    }
    paths["json"].write_text(
        json.dumps({"title": title, "columns": columns, "rows": table}, indent=2) + "\n"
    )
    paths["markdown"].write_text(f"# {title}\n\n" + format_markdown_table(rows, columns))
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["system", *columns])
        for system, metrics in rows.items():
            writer.writerow([system, *(_csv_value(_cell(metrics, c)) for c in columns)])
    _plot(rows, columns, title, paths["png"])
    return paths


def _plot(rows: Rows, columns: list[str], title: str, path: Path) -> None:
    """Grouped bars: one group per metric, one bar per system (missing cells left out)."""
    systems = list(rows)
    figure = Figure(figsize=(max(6.0, 1.0 + len(columns) * (0.4 + 0.25 * len(systems))), 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    width = 0.8 / len(systems)
    for offset, system in enumerate(systems):
        xs, heights = [], []
        for group, column in enumerate(columns):
            value = _cell(rows[system], column)
            if not math.isnan(value):
                xs.append(group - 0.4 + width * (offset + 0.5))
                heights.append(value)
        axes.bar(xs, heights, width=width, label=system)
    axes.set_xticks(range(len(columns)))
    axes.set_xticklabels(columns, rotation=30, ha="right")
    axes.set_title(title)
    axes.legend(fontsize="small")
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _check_rows(rows: Rows) -> None:
    if not rows:
        raise ValueError("a results table needs at least one row")
    for system, metrics in rows.items():
        if not isinstance(system, str) or not system:
            raise ValueError(f"row names must be non-empty strings, got {system!r}")
        if not isinstance(metrics, Mapping):
            raise TypeError(f"row {system!r} must map metric names to numbers")
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"row {system!r}, metric {name!r}: {value!r} is not a number")


def _cell(metrics: Mapping[str, float], column: str) -> float:
    return float(metrics.get(column, math.nan))


def _format_cell(value: float, precision: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{precision}f}"


def _json_value(value: float) -> float | None:
    return None if math.isnan(value) or math.isinf(value) else value


def _csv_value(value: float) -> str:
    return "" if math.isnan(value) else repr(value)


def _slug(title: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9]+", "_", title).strip("_").lower()
    return slug or "results"
