"""Disk reads priced on the checkpoint's own files (hardware/disk_reads): what a plan with experts on
disk is priced with, when this machine's own profile plans."""

from __future__ import annotations

import json
import os

import pytest
import torch

from runtime_fixtures import engine_config, rt  # noqa: F401  (fixture)
from tiered import LLM
from tiered.checkpoint import open_checkpoint
from tiered.hardware import disk_reads
from tiered.hardware.profile import HardwareProfile, LinearModel
from tiered.planner import auto

BOX = {"gemm/cpu/fp32": LinearModel(1e-5, 2e-11, 1.0), "gemv/cpu/fp32": LinearModel(0.0, 5e-11, 1.0),
       "attn/cpu/fp32": LinearModel(0.0, 1e-10, 1.0), "memory/bandwidth/cpu": LinearModel(0.0, 5e-11, 1.0),
       "memory/copy/cpu": LinearModel(0.0, 1e-10, 1.0), "disk/read_cold": LinearModel(1e-4, 5e-10, 1.0),
       "launch/cpu": LinearModel(1e-6, 0.0), "runtime/task": LinearModel(5e-5, 0.0)}


@pytest.fixture
def own_profile(monkeypatch, tmp_path):
    """The engine plans with 'this machine's own profile' (no EngineConfig.profile): a made-up CPU with a
    2 GB/s temp-file disk; tiered's cache directory is empty."""
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    hw = HardwareProfile("own", "measured on box", dict(BOX), None, 16 * 2**30)
    monkeypatch.setattr(auto, "engine_profile", lambda *a, **kw: hw)
    return hw


def disk_budget(rt) -> int:
    """A RAM budget that leaves most of the tiny Mixtral's experts on disk."""
    return rt.sizes("mixtral").fast(cache_slots=1, resident=1, accelerator=False)


def test_fit_expert_reads_times_the_runtimes_reads_of_distinct_cold_experts(rt, monkeypatch):
    """Each sample reads whole experts with the function ExpertStore.read uses (read_uncached), into
    buffers that exist already, none read by an earlier sample while the checkpoint has experts left;
    n = the sample's bytes. A checkpoint not stored in the compute dtype is refused (the runtime would
    read a converted copy)."""
    import tiered.memory.expert_store as es

    ck = open_checkpoint(rt.dir("mixtral"))
    cfg = ck.config
    reads, outs = [], set()
    real = es.read_uncached

    def spy(handles, out):
        reads.append(tuple(h.name for h in handles))
        outs.add(tuple(t.data_ptr() for t in out))
        real(handles, out)
    monkeypatch.setattr(es, "read_uncached", spy)
    import tiered.hardware.profiler as profiler
    fitted = []
    monkeypatch.setattr(profiler, "fit_affine", lambda xs, ys: fitted.append(list(xs)) or LinearModel(0.0, 1e-9))
    disk_reads.fit_expert_reads(ck, cfg, torch.float32)
    expert = sum(ck.handle(n).nbytes for n in es.expert_tensor_names(cfg.model_type, es.moe_layers(ck, cfg)[0], 0))
    assert fitted == [[n * expert for n in (1, 2, 3, 4)]]  # through each size's median
    # samples of 1, 2, 3, 4 experts, three times: 30 reads; every expert of the checkpoint once before any again
    n_keys = len(es.moe_layers(ck, cfg)) * cfg.num_experts
    assert len(reads) == 30 and len(set(reads[:min(30, n_keys)])) == min(30, n_keys)
    assert all(len(r) == 3 for r in reads) and len(outs) == 1  # one expert's buffers, reused
    reads.clear(), outs.clear()
    disk_reads.fit_expert_reads(ck, cfg, torch.float32, readers=2)
    assert len(reads) == 42 and len(outs) == 2  # (2, 4, 8) three times over two readers, a buffer each
    # a small budget: fewer, smaller samples (never fewer than two)
    reads.clear()
    disk_reads.fit_expert_reads(ck, cfg, torch.float32, budget_bytes=1)
    assert len(reads) == 3  # one sample each of 1 and 2 experts
    with pytest.raises(ValueError, match="not stored in the compute dtype"):
        disk_reads.fit_expert_reads(ck, cfg, torch.bfloat16)


def test_a_plan_with_experts_on_disk_is_priced_with_reads_of_the_checkpoint(rt, own_profile, monkeypatch):
    """engine_plan plans, sees experts on disk, times the checkpoint's expert reads (one reader and the
    runtime's two) and plans again with them: the plan's profile has the fits, its notes say so, and a
    slower disk prices a slower decode. The fit is cached (a second engine measures nothing)."""
    fits = []
    real = disk_reads.fit_expert_reads

    def counted(*a, **kw):
        fits.append(kw.get("readers", 1))
        return real(*a, **kw)
    monkeypatch.setattr(disk_reads, "fit_expert_reads", counted)
    llm = LLM(rt.dir("mixtral"), engine_config(cpu_memory=disk_budget(rt)))
    try:
        assert any(l.experts_disk for l in llm.plan.layers)
        assert fits == [1, 2]
        hw = llm._profile
        assert hw.meta["disk_reads_fitted"] == "the checkpoint's files"
        assert hw.models["disk/read_cold"] != BOX["disk/read_cold"] and "disk/read_cold_parallel" in hw.models
        assert any("disk reads of experts timed on the checkpoint's files" in n for n in llm.plan.notes)
        cached = json.loads(disk_reads.cache_path().read_text())
        (entry,) = cached.values()
        assert LinearModel(**entry["disk/read_cold"]) == hw.models["disk/read_cold"]
        tokens_s = llm.plan.predicted_decode_tokens_per_s
    finally:
        llm.close()
    again = LLM(rt.dir("mixtral"), engine_config(cpu_memory=disk_budget(rt)))
    assert fits == [1, 2] and again._profile.models["disk/read_cold"] == hw.models["disk/read_cold"]
    again.close()
    # a disk 100x slower than the fit (and 1 ms more a read): the same engine prices its decode slower
    slow = {k: LinearModel(m.alpha * 100 + 1e-3, m.beta * 100, m.r2) for k, m in hw.models.items() if k.startswith("disk/read")}
    monkeypatch.setattr(disk_reads, "fitted_disk_reads", lambda *a, **kw: slow)
    llm = LLM(rt.dir("mixtral"), engine_config(cpu_memory=disk_budget(rt)))
    assert llm.plan.predicted_decode_tokens_per_s < tokens_s
    llm.close()


def test_converted_experts_are_priced_with_reads_of_their_copies_once_written(rt, own_profile, tmp_path):
    """int4 experts are read from converted copies in the offload directory: a first load has none to time and
    keeps the profile's rate; a later load times reads of the copies the first wrote (one reader and the runtime's
    two; cached per device and expert size) and plans with them, and says so. The fit holds no file open."""
    from tiered.checkpoint.handle import _FDS

    off = tmp_path / "off"
    config = engine_config(accelerator="none", expert_weights="int4", offload_dir=str(off), resident_experts=0,
                           expert_cache_slots=1)
    first = LLM(rt.dir("mixtral"), config)
    assert any(l.experts_disk for l in first.plan.layers) and first.experts.store.written_files
    assert "disk_reads_fitted" not in first._profile.meta
    first.close()
    again = LLM(rt.dir("mixtral"), config)
    hw = again._profile
    assert hw.meta["disk_reads_fitted"] == f"the converted experts in {off}"
    assert hw.models["disk/read_cold"] != BOX["disk/read_cold"] and "disk/read_cold_parallel" in hw.models
    assert any(f"disk reads of experts timed on the converted experts in {off}" in n for n in again.plan.notes)
    (entry,) = [v for k, v in json.loads(disk_reads.cache_path().read_text()).items() if k.startswith("offload reads")]
    assert LinearModel(**entry["disk/read_cold"]) == hw.models["disk/read_cold"]
    again.close()
    assert not any(k[0].startswith(str(off)) for k in _FDS)


def test_no_disk_fit_without_experts_on_disk_with_a_given_profile_or_when_turned_off(rt, own_profile, monkeypatch,
                                                                                   tmp_path):
    calls = []
    monkeypatch.setattr(disk_reads, "fitted_disk_reads", lambda *a, **kw: calls.append(a) or None)
    LLM(rt.dir("mixtral"), engine_config()).close()  # everything in RAM
    given = tmp_path / "given.json"
    own_profile.save(given)
    LLM(rt.dir("mixtral"), engine_config(cpu_memory=disk_budget(rt), profile=str(given))).close()
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(auto, "engine_profile", lambda *a, **kw: own_profile)
    monkeypatch.setenv("TIERED_DISK_FIT", "0")
    llm = LLM(rt.dir("mixtral"), engine_config(cpu_memory=disk_budget(rt)))
    assert llm._profile.models["disk/read_cold"] == BOX["disk/read_cold"]
    assert not (tmp_path / "cache" / "disk_reads.json").exists()
    llm.close()


def test_an_experts_tensors_stored_side_by_side_are_read_with_one_preadv(rt, monkeypatch):
    """read_uncached (ExpertStore.read): an expert's gate, up and down tensors, adjacent in the file,
    come in one preadv into their three buffers, in any order asked, with the right bytes; a buffer of
    another dtype than the stored one is read by itself (converted), the others still together; each
    run's pages are dropped with one call."""
    import tiered.memory.expert_store as es

    ck = open_checkpoint(rt.dir("mixtral"))
    names = es.expert_tensor_names(ck.config.model_type, es.moe_layers(ck, ck.config)[0], 1)
    hs = [ck.handle(n) for n in names]
    assert sorted(h.offset for h in hs)[1] == min(h.offset for h in hs) + min(hs, key=lambda h: h.offset).nbytes
    calls, drops = [], []
    real_preadv, real_advise = os.preadv, os.posix_fadvise
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append(len(bufs)) or real_preadv(fd, bufs, off))
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, advice: drops.append(n) or real_advise(fd, off, n, advice))
    order = [2, 0, 1]
    out = [torch.empty(hs[i].shape, dtype=torch.float32) for i in order]
    es.read_uncached([hs[i] for i in order], out)
    assert calls == [3] and drops == [sum(h.nbytes for h in hs)]
    for i, t in zip(order, out):
        assert torch.equal(t, hs[i].load(torch.float32))
    calls.clear(), drops.clear()
    out = [torch.empty(hs[0].shape, dtype=torch.bfloat16)] + [torch.empty(h.shape, dtype=torch.float32) for h in hs[1:]]
    es.read_uncached(hs, out)
    assert torch.equal(out[0], hs[0].load(torch.float32).bfloat16())
    assert all(torch.equal(t, h.load(torch.float32)) for h, t in zip(hs[1:], out[1:]))
    contiguous_rest = sorted(h.offset for h in hs[1:])[1] == min(h.offset for h in hs[1:]) + hs[1].nbytes
    assert len(drops) == (2 if contiguous_rest else 3)


def _resident_pages(path: str) -> set[int]:
    """Indices of `path`'s 4 KiB pages in the OS page cache (mincore over a read-only mapping)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    os.close(fd)
    pages = (size + 4095) // 4096
    vec = (ctypes.c_ubyte * pages)()
    try:
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    return {i for i in range(pages) if vec[i] & 1}


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise and mincore (Linux)")
def test_an_expert_read_leaves_no_page_of_the_file_in_the_page_cache(tmp_path):
    """read_uncached reads with the kernel's read-ahead off and drops what it read: afterwards no page of
    the file is cached but the two its range shares with its neighbours (with read-ahead on, a 22 MiB
    expert left the next 11 MiB of its file cached, outside every budget)."""
    import struct

    from safetensors.torch import save_file

    import tiered.memory.expert_store as es
    from tiered.checkpoint.handle import TensorHandle

    path = str(tmp_path / "experts.safetensors")
    g = torch.Generator().manual_seed(0)
    tensors = {f"e{i}.{w}": torch.randn(512, 1024, generator=g) for i in range(2) for w in ("w1", "w2", "w3")}
    save_file(tensors, path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    hs = [TensorHandle(k, (512, 1024), "F32", 512 * 1024 * 4, path, lambda k=k: tensors[k],
                       offset=base + header[k]["data_offsets"][0]) for k in ("e0.w1", "e0.w2", "e0.w3")]
    first, end = min(h.offset for h in hs), min(h.offset for h in hs) + sum(h.nbytes for h in hs)
    assert end == max(h.offset + h.nbytes for h in hs)  # the three side by side
    es.drop_page_cache([path])  # just written: its dirty pages are written back first, then dropped
    assert _resident_pages(path) == set()
    out = [torch.empty(512, 1024) for _ in hs]
    es.read_uncached(hs, out)
    assert all(torch.equal(t, tensors[h.name]) for h, t in zip(hs, out))
    assert _resident_pages(path) <= {first // 4096, (end - 1) // 4096}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_closing_an_llm_unmaps_its_checkpoint_so_the_page_cache_can_be_dropped(rt, tmp_path):
    """LLM.close() unmaps the checkpoint's files (checkpoint.release_pages) while the LLM object lives on
    (an engine's reference cycles keep it until the garbage collector runs): else the OS cannot drop the
    file's pages, and the next engine's disk reads come from the page cache."""
    import shutil

    import tiered.memory.expert_store as es

    path = shutil.copytree(rt.dir("mixtral"), tmp_path / "mixtral")
    mapped = lambda: [line for line in open("/proc/self/maps") if str(path) in line]  # noqa: E731
    llm = LLM(path, engine_config(expert_weights="int4", offload_dir=str(tmp_path / "offload")))
    llm.checkpoint.handle(llm.checkpoint.names()[0]).load()  # a load after the engine's: mapped again
    assert mapped()
    llm.close()
    assert mapped() == []
    files = [str(p) for p in path.glob("*.safetensors")]
    es.drop_page_cache(files)  # the copy's dirty pages written back, then dropped
    assert all(_resident_pages(f) == set() for f in files)


def test_a_layers_expert_reads_are_priced_as_the_runtime_issues_them(rt):
    """cpu_predict.experts_with_reads: decode overlaps read-ahead's stream (disk/read_cold_parallel) with the
    computes; a prompt (predict_prefill) streams its reads the same way but beside the computes, not under
    them; without read-ahead each miss is read, then computed."""
    from tiered.planner.cpu_predict import experts_with_reads, predict_prefill

    par = LinearModel(5e-3, 1e-10)
    hw = HardwareProfile("box", "test", {**BOX, "disk/read_cold_parallel": par})
    eb, c, over = 1e7, 2e-3, 1e-4
    read = BOX["disk/read_cold"](eb)
    assert experts_with_reads(hw, 8, 0, eb, c, True, 2, over) == pytest.approx(8 * c)
    assert experts_with_reads(hw, 8, 6, eb, c, False, 2, over) == pytest.approx(8 * c + 6 * (read + over))
    stream = par(6 * eb) + 6 * over
    assert experts_with_reads(hw, 8, 6, eb, c, True, 2, over) == pytest.approx(max(stream + c, 8 * c))
    assert experts_with_reads(hw, 8, 6, eb, c, True, 2, over, overlap=False) == pytest.approx(stream + 8 * c)
    # one reader: the single-reader line back to back
    assert experts_with_reads(hw, 8, 6, eb, c, True, 1, over) == pytest.approx(max(6 * (read + over) + c, 8 * c))
    cfg = open_checkpoint(rt.dir("mixtral")).config
    hw = HardwareProfile("box", "test", {**BOX, "disk/read_cold_parallel": LinearModel(0.0, 1e-11)})
    ahead = predict_prefill(cfg, hw, "fp32", 64, disk_share=0.8, read_ahead=True)
    serial = predict_prefill(cfg, hw, "fp32", 64, disk_share=0.8, read_ahead=False)
    in_ram = predict_prefill(cfg, hw, "fp32", 64)
    assert in_ram < ahead < serial  # two readers stream faster than BOX's one, here


def test_a_disk_fit_that_cannot_read_keeps_the_profiles_rate_and_says_so(rt, own_profile, monkeypatch):
    def unreadable(*a, **kw):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(disk_reads, "fit_expert_reads", unreadable)
    llm = LLM(rt.dir("mixtral"), engine_config(cpu_memory=disk_budget(rt)))
    try:
        assert llm._profile.models["disk/read_cold"] == BOX["disk/read_cold"]
        assert any("could not time expert reads" in n and "Input/output error" in n for n in llm.plan.notes)
    finally:
        llm.close()

