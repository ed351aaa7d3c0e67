"""Shared pieces of the planner-against-measurement tests (test_reference_h200*.py): a reference
file's rows compared with the plans' predictions, and one pytest case per comparable row and metric,
a strict xfail where the models are known to miss (`unmet`: (row name, metric) -> reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered.planner.reference import METRICS, compare, load_reference

TOLERANCE = 0.25  # |predicted - measured| / measured that a comparable row must meet


def compared_rows(path: Path) -> dict[str, dict]:
    ref, hw = load_reference(path)
    return {r["name"]: r for r in compare(ref, hw)}


def cases(path: Path, unmet: dict[tuple[str, str], str]) -> list:
    ref, _ = load_reference(path)
    out = []
    for row in ref["rows"]:
        if not row.get("comparable", True):
            continue
        for metric in METRICS:
            reason = unmet.get((row["name"], metric))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param(row["name"], metric, marks=marks, id=f"{row['name']}-{metric}"))
    return out
