"""Shared pieces of the planner-against-measurement tests (test_reference_h200*.py): a reference
file's rows compared with the plans' predictions (`rows_fixture`), one pytest case per comparable
row and metric, a strict xfail where the models are known to miss (`unmet`: (row name, metric) ->
reason), and the 25% check each case makes (`assert_within_tolerance`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered.planner.reference import METRICS, compare, load_reference

TOLERANCE = 0.25  # |predicted - measured| / measured that a comparable row must meet


def compared_rows(path: Path) -> dict[str, dict]:
    ref, hw = load_reference(path)
    return {r["name"]: r for r in compare(ref, hw)}


def rows_fixture(path: Path):
    """A module-scoped fixture `rows`: compared_rows(path), computed once per test module."""
    return pytest.fixture(scope="module", name="rows")(lambda: compared_rows(path))


def assert_within_tolerance(rows: dict[str, dict], name: str, metric: str) -> None:
    r = rows[name]
    assert r["error"][metric] <= TOLERANCE, (name, metric, r["predicted"][metric], r["measured"][metric])


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
