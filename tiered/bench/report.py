"""Benchmark reports: one JSON with everything, one Markdown table to read.

    write_report("gpu_offload", out_dir, title=..., settings={...}, rows=[{...}, ...],
                 columns=[Column("configuration", "config"), Column("decode tok/s", "decode_tokens_per_s", "{:.1f}")])

writes out_dir/gpu_offload.json ({"benchmark", "date", "command", "machine", "settings", "rows",
...extra}) and out_dir/gpu_offload.md (title, date, machine, settings, the table, notes). A row
that failed carries "error" (or "skipped") instead of numbers; the table shows it in place of them.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tiered.bench.machine import describe, machine_info

MISSING = "–"


@dataclass(frozen=True)
class Column:
    """One table column: its header, the row key (or a function of the row) and a format for values."""

    header: str
    key: str | Callable[[dict], Any]
    fmt: str = "{}"

    def cell(self, row: dict) -> str:
        value = self.key(row) if callable(self.key) else row.get(self.key)
        if value is None:
            return MISSING
        return self.fmt.format(value) if not isinstance(value, str) else value


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A Markdown table of `rows`. A row with "error" or "skipped" shows its first column, then
    the message in the second cell, and leaves the rest empty."""
    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        reason = row.get("error") or row.get("skipped")
        if reason:
            what = "skipped: " if row.get("skipped") and not row.get("error") else ""
            cells = [columns[0].cell(row), what + _one_line(reason)] + [""] * (len(columns) - 2)
        else:
            cells = [c.cell(row) for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(name: str, out_dir: str | Path, *, title: str, settings: dict, rows: Sequence[dict],
                 columns: Sequence[Column] | None = None, body: str | None = None, notes: Sequence[str] = (),
                 machine: dict | None = None, extra: dict | None = None, date: str | None = None) -> tuple[Path, Path]:
    """Write out_dir/NAME.json and out_dir/NAME.md; return their paths.

    Args:
        settings: what the run was asked to do (shapes, budgets, token counts, repeats).
        rows: one dict per configuration measured (JSON-able; other values are written with str()).
        columns: the Markdown table's columns; or `body`, Markdown to put in place of the table.
        notes: Markdown paragraphs after the table.
        machine: machine_info() of the machine (measured now when None).
        extra: more top-level JSON fields (raw runs, traces).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    machine = machine if machine is not None else machine_info()
    date = date or dt.datetime.now().astimezone().isoformat(timespec="seconds")
    doc = {"benchmark": name, "date": date, "command": " ".join(["python"] + sys.argv),
           "machine": machine, "settings": settings, "rows": list(rows), **(extra or {})}
    json_path, md_path = out / f"{name}.json", out / f"{name}.md"
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    table = body if body is not None else markdown_table(rows, columns or [])
    md = [f"# {title}", "", f"{date}. Ran on {describe(machine)}.", "",
          "Settings: " + ", ".join(f"{k} {_short(v)}" for k, v in settings.items()) + ".", "", table]
    for note in notes:
        md += ["", note]
    md_path.write_text("\n".join(md) + "\n")
    return json_path, md_path


def _short(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"
