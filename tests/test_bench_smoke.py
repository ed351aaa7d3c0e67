"""benchmarks/gpu_offload.py --smoke: the GPU benchmark runs end to end on the host stand-in.

The script is run as CI would run it on a GPU machine, in its own process, at tiny shapes; the
test then reads its report and checks that every configuration row is there with numbers (or a
recorded error where one is allowed), that the budgeted MoE rows really offloaded experts along
the path each forces, and that the Markdown table names every row. Whatever breaks the script
(an import, an API it uses, the report) fails here. About 10-20 s on 2 cores.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_offload.py"
TIERED_ROWS = ("plan_auto", "plan_auto_eager", "plan_auto_cuda_pinned", "plan_auto_huge_pinned", "plan_auto_worker_issue",
               "plan_off", "no_gpu", "unconstrained", "unconstrained_eager")
ROWS = {"moe": TIERED_ROWS + ("plan_auto_profiled", "forced_copy", "forced_cpu", "forced_split", "forced_priced",
                              "hf_accelerate",
                              "hf_all_gpu"),
        "dense": TIERED_ROWS + ("hf_accelerate", "hf_all_gpu")}
# dense with `plan="off"` has no way to offload FFN rows (the H200 run recorded a BudgetError)
MAY_FAIL = {("dense", "plan_off")}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("gpu_offload_smoke")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--workdir", str(out / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "gpu_offload_smoke.json").read_text())
    return doc, (out / "gpu_offload_smoke.md").read_text()


def _rows(doc: dict) -> dict[tuple[str, str], dict]:
    return {(r["shape"], r["id"]): r for r in doc["rows"]}


def test_every_configuration_has_a_row(report):
    doc, md = report
    rows = _rows(doc)
    assert set(rows) == {(shape, rid) for shape, ids in ROWS.items() for rid in ids}
    assert len(doc["rows"]) == len(rows)  # no configuration twice
    for r in rows.values():
        assert r["config"] in md


def test_rows_hold_numbers_or_an_allowed_error(report):
    for key, r in _rows(report[0]).items():
        if "error" in r:
            assert key in MAY_FAIL, f"{key} failed: {r['error']}"
            assert r["error"].strip()
            continue
        for field in ("ttft_s", "decode_tokens_per_s", "peak_rss_gib"):
            assert isinstance(r[field], float) and math.isfinite(r[field]) and r[field] > 0, (key, field, r[field])
        assert len(r["decode_runs_tokens_per_s"]) == report[0]["settings"]["repeats"]


def test_offloading_happened_along_the_forced_paths(report):
    rows = _rows(report[0])
    for rid in ("plan_auto", "plan_off", "forced_copy", "forced_cpu"):
        r = rows["moe", rid]
        assert r["misses"] > 0, (rid, r["placement"])  # some experts were not on the stand-in GPU
        assert 0 < r["peak_gpu_gib"] * 2**30 <= report[0]["settings"]["gpu_memory_bytes"]["moe"]
    assert rows["moe", "forced_copy"]["paths"].get("copy", 0) > 0
    assert "copy" not in rows["moe", "forced_cpu"]["paths"]
    assert rows["moe", "forced_cpu"]["paths"].get("cpu", 0) > 0
    assert set(rows["moe", "unconstrained"]["paths"]) == {"resident"}
    # the expert profile the plan_auto_profiled row planned with was recorded, and the plan priced its skew
    profiled = rows["moe", "plan_auto_profiled"]
    assert "expert_profile=" in profiled["engine_config"] and "expert_profile=None" not in profiled["engine_config"]


def test_plan_predictions_are_reported(report):
    rows = _rows(report[0])
    for shape in ("moe", "dense"):
        auto = rows[shape, "plan_auto"]
        assert auto["predicted_decode_tokens_per_s"] > 0 and auto["predicted_ttft_s"] > 0
        assert rows[shape, "hf_all_gpu"].get("predicted_decode_tokens_per_s") is None
    assert rows["moe", "plan_off"]["predicted_decode_tokens_per_s"] is None


def test_report_carries_machine_and_settings(report):
    doc, md = report
    assert doc["benchmark"] == "gpu_offload_smoke" and doc["settings"]["smoke"] is True
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["versions"]["torch"]
    assert doc["model_shapes"]["moe"]["experts"] == 8
    assert "| configuration |" in md and "SMOKE" in md


def test_the_stall_probe_runs_on_the_stand_in(tmp_path):
    """benchmarks/gpu_stall_probe.py --smoke: each configuration in its own process gives a decode
    speed, the profiler's ops and the thread samples (what the next GPU session runs, `gpu_checks.sh stall`)."""
    probe = REPO / "benchmarks" / "gpu_stall_probe.py"
    proc = subprocess.run([sys.executable, str(probe), "--smoke", "--out", str(tmp_path),
                           "--configs", "moe_resident_balanced,dense_default"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (tmp_path / "stall_probe.md").read_text()
    assert ": failed (rc" not in md and md.count("\ndecode ") == 2 and "main: " in md
    for name in ("moe_resident_balanced", "dense_default"):
        text = (tmp_path / f"stall_{name}.txt").read_text()
        assert "Self CPU" in text and "late samples" in text


def test_the_dram_share_probe_runs_without_a_gpu(tmp_path):
    """benchmarks/gpu_dram_share.py --smoke: every configuration gives its rates (host copies stand in
    for H2D), so `gpu_checks.sh share` runs on the next lent GPU."""
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_dram_share.py"), "--smoke",
                           "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_dram_share.json").read_text())["rows"]
    assert len(rows) == 10 and rows[0]["cpu_GBps"] > 0 and rows[1]["h2d_GBps"] > 0
    assert all(r["cpu_GBps"] > 0 and r["h2d_GBps"] > 0 for r in rows[2:5])
    prompt = rows[6:]  # a prefill's CPU experts: hot, cold, cold beside the copies (all threads, all but one)
    assert all(r["config"].startswith("prompt expert (128 tokens)") and r["cpu_ms"] > 0 for r in prompt)
    assert all(r["h2d_GBps"] > 0 for r in prompt[2:])


def test_default_rows_decode_through_graphs_and_the_eager_row_does_not(report):
    """--smoke turns the stand-in's graphs on: the default plan's decode steps go through piecewise
    (MoE, sliced dense) graphs and the unconstrained rows' through whole-step graphs (MoE: grouped
    expert GEMMs), recorded per row; the --graphs off rows have none."""
    rows = _rows(report[0])
    for shape in ROWS:
        for rid, kind in (("plan_auto", "PiecewiseGraphs"), ("unconstrained", "DecodeGraphs")):
            g = rows[(shape, rid)]["graphs"]
            assert g["kind"] == kind and g["disabled"] is None and g["steps"] > 0 and g["captures"] >= 1
        assert "graphs" not in rows[(shape, "plan_auto_eager")] and "graphs" not in rows[(shape, "unconstrained_eager")]


def test_the_report_checks_issue_8s_targets(report):
    """Section 3's checks from session 28's H100 rows (uniform routing, call 6): the default's decode 27.4
    tok/s misses both 40 and 5% of forced CPU's 33.5; its TTFT 0.238 s is within 5% of forced copy's 0.229;
    forced CPU's decode prediction (39.9 against 33.5) is within 25%, the default's (40.5 against 27.4) is
    not. The smoke report carries the same checks per shape."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_offload import targets

    rows = [{"id": "plan_auto", "decode_tokens_per_s": 27.4, "ttft_s": 0.238, "predicted_decode_tokens_per_s": 40.5},
            {"id": "forced_copy", "decode_tokens_per_s": 17.6, "ttft_s": 0.229},
            {"id": "forced_cpu", "decode_tokens_per_s": 33.5, "ttft_s": 0.416, "predicted_decode_tokens_per_s": 39.9},
            {"id": "no_gpu", "error": "out of memory"}]
    met = {c["check"].split(" (")[0]: c["met"] for c in targets("moe", rows)}
    assert met["default plan decode tok/s"] is False
    assert met["default plan decode tok/s within 5% of the best of forced_copy, forced_cpu, no_gpu"] is False
    assert met["default plan TTFT s within 5% of the best of forced_copy, forced_cpu, no_gpu"] is True
    assert met["plan_auto: decode prediction's error"] is False and met["forced_cpu: decode prediction's error"] is True
    assert not any("no_gpu:" in c for c in met)  # a failed row is not checked
    doc, md = report
    assert set(doc["targets"]) == {"moe", "dense"} and "Issue 8's targets, moe" in md
    assert {c["check"] for c in doc["targets"]["dense"]} >= {"default plan decode tok/s", "default plan TTFT s"}


def test_the_bandwidth_check_plans_with_the_scaled_profile_and_saves_it(tmp_path, monkeypatch):
    """--bandwidth-check: the given profile scaled as the engine scales its own (bandwidth_now), saved beside
    the report for the replays; unscaled, the profile as given."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_offload import checked_profile
    from tiered.hardware.presets import get_preset
    from tiered.hardware.profile import scale_cpu_bandwidth
    from tiered.planner import auto

    src = tmp_path / "hw.json"
    get_preset("scheinfer-a").save(src)
    monkeypatch.setattr(auto, "bandwidth_now", lambda hw: scale_cpu_bandwidth(hw, 1.4))
    path, what = checked_profile(str(src), tmp_path / "out" / "run_profile.json")
    assert path == str(tmp_path / "out" / "run_profile.json") and "0.71x" in what
    from tiered.hardware.profile import HardwareProfile
    assert HardwareProfile.load(path).meta["cpu_bandwidth_ratio"] == 1.4
    monkeypatch.setattr(auto, "bandwidth_now", lambda hw: hw)
    assert checked_profile(str(src), tmp_path / "again.json")[0] == str(src) and not (tmp_path / "again.json").exists()
