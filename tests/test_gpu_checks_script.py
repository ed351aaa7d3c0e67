"""scripts/gpu_checks.sh, the one command a session with a lent GPU runs, checked on this machine:
GPU_CHECKS_SMOKE=1 runs its stages with the benchmarks' --smoke (host stand-in, tiny shapes), so a
broken stage, a row id the benchmark does not know or a result the pack misses shows here, not in
the GPU session's few minutes."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_gpu_checks_stages_run_and_pack_their_results(tmp_path):
    env = dict(os.environ, GPU_CHECKS_SMOKE="1", PYTHON=sys.executable, OUT=str(tmp_path / "out"),
               GPU_RES=str(tmp_path / "res"), GPU_DEADLINE="400")
    (tmp_path / "out").mkdir()
    proc = subprocess.run(["bash", "scripts/gpu_checks.sh", "graphs", "dense", "pinned", "memory", "moe_ab", "share",
                           "kernelprobe", "moe_uniform", "threads", "issue", "nosuchstage"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    for stage in ("pytest_graphs", "graphs_moe", "graphs_dense", "gpu_offload_dense", "pinned_dense", "pinned_moe",
                  "memory_probe", "gpu_offload_moe_ab", "dram_share", "kernel_probe", "gpu_offload_moe_uniform",
                  "gpu_offload_moe_uniform_t15", "issue_moe", "issue_dense"):
        assert f"== {stage}: rc 0" in log, log[-3000:]
    assert "unknown stage nosuchstage" in log
    with tarfile.open(tmp_path / "out" / "gpu_results.tgz") as tgz:
        names = {n.lstrip("./") for n in tgz.getnames()}
    assert {"versions.txt", "lscpu.txt", "thp.txt", "gpu_offload_dense_smoke.json", "graphs/graphs_dense.json",
            "pinned/pinned_moe.json", "memory/memory_probe.json", "ab/gpu_offload_moe_ab.json", "gpu_dram_share.json",
            "kernelprobe/kernel_probe.json", "uniform/gpu_offload_moe_uniform.json",
            "uniform/gpu_offload_moe_uniform_t15.json", "issue/issue_moe.json", "issue/issue_dense.json"} <= names
    assert (tmp_path / "out" / "run.log").read_text().count("== done in") == 1
