"""benchmarks/gpu_memory_probe.py's replay of the CUDA caching allocator's recorded events: the peak of
live bytes and the blocks live at that moment, grouped by allocation site (checked on made-up events:
the real ones need a GPU), and the probe's stand-in run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_memory_probe import peak_sites, site  # noqa: E402


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_site_is_the_innermost_frame_in_tiered_else_python():
    torch_frame = frame("/usr/lib/python3/site-packages/torch/nn/functional.py", 10, "linear")
    ours = frame("/work/main/tiered/runtime/sliced.py", 42, "forward")
    assert site([frame("??", 0, "cublas"), torch_frame, ours]) == "tiered/runtime/sliced.py:42 forward"
    assert site([frame("??", 0, "cublas"), torch_frame]) == "functional.py:10 linear"
    assert site([frame("??", 0, "cublas")]) == "(no Python frame)"


def test_peak_sites_replays_allocs_and_frees_to_the_peak():
    a = [frame("/x/tiered/a.py", 1, "f")]
    b = [frame("/x/tiered/b.py", 2, "g")]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "stream": 0, "frames": a},
        {"action": "alloc", "addr": 2, "size": 50, "stream": 7, "frames": b},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 3, "size": 30, "stream": 0, "frames": a},   # still 180 live: 1 not yet freed
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 60, "stream": 0, "frames": b},   # 140 live
    ]
    r = peak_sites(events)
    assert r["peak_bytes"] == 180 and r["events"] == 6
    assert r["sites"] == [{"bytes": 130, "blocks": 2, "site": "tiered/a.py:1 f", "stream": 0},
                          {"bytes": 50, "blocks": 1, "site": "tiered/b.py:2 g", "stream": 7}]
    # recorded without completed frees: the requested ones count
    no_completed = [e for e in events if e["action"] != "free_completed"]
    assert peak_sites(no_completed)["peak_bytes"] == 150


def test_kernels_fall_into_their_categories():
    from gpu_kernel_probe import category

    assert category("void cutlass::Kernel2<cutlass_80_grouped_gemm_bf16>(...)") == "grouped"
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x32x64") == "gemm"
    assert category("void at::native::(anonymous namespace)::cunn_SoftMaxForward") == "attention"
    assert category("void at::native::radixSortKVInPlace<...>") == "routing"
    assert category("Memcpy DtoH (Device -> Pageable)") == "copy"
    assert category("void at::native::vectorized_elementwise_kernel<4, silu>") == "elementwise"
    assert category("some_kernel") == "other"


@pytest.mark.slow
@pytest.mark.parametrize("script, report, sections, expect", [
    ("gpu_memory_probe.py", "memory_probe.md", ("dense_default", "moe_default"), "peak allocated"),
    ("gpu_kernel_probe.py", "kernel_probe.md", ("moe_all_gpu", "dense_all_gpu"), "| gemm |"),  # the stand-in's aten::mm
])
def test_the_probes_run_on_the_stand_in(tmp_path, script, report, sections, expect):
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), "--smoke", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    md = (tmp_path / report).read_text()
    assert all(f"## {name}" in md for name in sections) and "failed" not in md and expect in md
