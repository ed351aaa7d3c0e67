"""Memory budgets (never exceeded, clear errors), sizes, the expert cache and popularity placement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime_fixtures import GREEDY, engine_config, live_device_bytes, prompt, rt  # noqa: F401

from tiered import LLM
from tiered.errors import BudgetError, ConfigError
from tiered.hardware.budget import MemoryBudget, format_bytes, parse_bytes
from tiered.memory.expert_cache import ExpertCache, LFUPolicy, LRUPolicy
from tiered.planner.placement import CPU, DISK, FAST, plan_expert_placement


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize("text, want", [
    ("12GiB", 12 * 2**30), ("512MB", 512 * 10**6), ("1.5g", int(1.5 * 2**30)), ("1024", 1024),
    (" 64 KiB ", 64 * 1024), ("3mib", 3 * 2**20), ("2k", 2048), ("10b", 10), ("1TB", 10**12), (".5M", 2**19),
    (4096, 4096), (1e6, 10**6), (None, None),
])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text", ["", "abc", "12 XB", "1.2.3GiB", "-5MiB", "GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ConfigError, match="memory size"):
        parse_bytes(text)


@pytest.mark.parametrize("n, want", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"),
    (12 * 2**30, "12.0 GiB"), (2**40, "1.0 TiB"), (2**50, "1024.0 TiB"),
])
def test_format_bytes(n, want):
    assert format_bytes(n) == want


def test_format_parse_round_trip():
    for n in (1, 1000, 2**20 + 7, 5 * 2**30):
        back = parse_bytes(format_bytes(n).replace(" ", ""))
        assert abs(back - n) <= 0.05 * n


def test_engine_config_reads_sizes():
    cfg = engine_config(gpu_memory="3MiB", cpu_memory=12345)
    assert (cfg.gpu_memory, cfg.cpu_memory) == (3 * 2**20, 12345)
    with pytest.raises(ConfigError):
        engine_config(gpu_memory="lots")


# ------------------------------------------------------------------ MemoryBudget
def test_budget_reserve_release_peak():
    b = MemoryBudget("gpu", 100)
    b.reserve(60, "a")
    assert b.fits(40) and not b.fits(41)
    with pytest.raises(BudgetError, match=r"gpu budget exceeded: b needs 41 B, 40 B of 100 B left") as e:
        b.reserve(41, "b")
    assert "--gpu-mem" in e.value.hint
    assert b.used == 60  # nothing reserved by the failed call
    b.reserve(40)
    b.release(70)
    assert (b.used, b.peak, b.free) == (30, 100, 70)
    with pytest.raises(AssertionError):
        b.release(31)


def test_unlimited_budget():
    b = MemoryBudget("cpu", None)
    b.reserve(10**15)
    assert b.free == float("inf") and b.fits(10**18)


def test_tight_budgets_hold_what_the_device_really_holds(rt, tmp_path):
    """Tight budgets on both tiers, computed from the checkpoint files' own byte counts (exactly what
    the placement needs), experts on all three tiers: the plan fills both tiers exactly, and while
    generating, what the stand-in's device really holds (its live tensors) stays within the GPU budget."""
    import gc

    kind = "mixtral"
    s = rt.sizes(kind)
    gc.collect()
    baseline = live_device_bytes()  # device tensors of other engines still alive
    llm = LLM(rt.dir(kind), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2, resident=3),
                                          cpu_memory=s.cpu(5), expert_cache_slots=2,
                                          offload_dir=str(tmp_path)))
    held = []
    real = llm.model.lm_head.forward

    def spy(h):  # every step, on the device: what the stand-in holds right now (activations too)
        held.append(live_device_bytes() - baseline)
        return real(h)
    try:
        llm.model.lm_head.forward = spy
        out = llm.generate([prompt(seed=3)], GREEDY)[0]
        assert len(out.token_ids) == 16
        llm.logits(prompt(seed=4))
    finally:
        llm.experts.executor.close()
    assert held and max(held) <= llm.fast_budget.capacity
    # the plan fills the fast tier exactly: non-expert + staging + cache + resident + KV room + workspace
    assert llm.fast_budget.peak == llm.fast_budget.capacity
    assert llm.cpu_budget.peak == llm.cpu_budget.capacity  # host staging + 5 CPU experts


def test_tight_cpu_budget_is_filled_exactly_no_accelerator(rt):
    kind = "olmoe"
    s = rt.sizes(kind)
    llm = LLM(rt.dir(kind), engine_config(accelerator="none", cpu_memory=s.fast(cache_slots=1, resident=2, accelerator=False),
                                          expert_cache_slots=1, read_ahead=False))
    try:
        llm.generate([prompt(seed=5)], GREEDY)
    finally:
        llm.experts.executor.close()
    assert llm.experts.placement.count(FAST) == 2
    assert llm.cpu_budget.peak == llm.cpu_budget.capacity


def test_budget_too_small_for_non_expert_weights(rt):
    s = rt.sizes("mixtral")
    with pytest.raises(BudgetError, match="the non-expert weights") as e:
        LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.nonexpert - 1))
    assert "gpu budget" in e.value.message.lower() and "--gpu-mem" in e.value.hint
    with pytest.raises(BudgetError, match="CPU budget .* cannot hold the non-expert weights"):
        LLM(rt.dir("mixtral"), engine_config(accelerator="none", cpu_memory=s.nonexpert // 2))


def test_budget_too_small_for_staging(rt):
    s = rt.sizes("mixtral")
    with pytest.raises(BudgetError, match=r"and staging \(72.0 KiB\)") as e:
        LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.nonexpert + s.expert))
    assert f"raise --gpu-mem by {format_bytes(2 * s.expert + s.kv + s.rotary + s.workspace - s.expert)}" in e.value.hint
    with pytest.raises(BudgetError, match="staging buffers"):
        LLM(rt.dir("mixtral"), engine_config(accelerator="none", cpu_memory=s.nonexpert + s.expert))


def test_budget_too_small_for_kv_cache(rt):
    s = rt.sizes("qwen3_moe")  # its KV cache (32 KiB) is larger than one expert (24 KiB)
    with pytest.raises(BudgetError, match="KV cache") as e:
        LLM(rt.dir("qwen3_moe"), engine_config(accelerator="none", cpu_memory=s.fast(0, accelerator=False) - 1))
    assert "--max-context" in e.value.hint


def test_budget_too_small_for_cache_slots(rt):
    s = rt.sizes("mixtral")
    with pytest.raises(BudgetError, match="4 cache slots need 144.0 KiB"):
        LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=3),
                                             expert_cache_slots=4))


def test_cpu_budget_too_small_for_host_staging(rt):
    s = rt.sizes("mixtral")
    with pytest.raises(BudgetError, match="CPU budget .* cannot hold the 2 host staging buffers"):
        LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(2), cpu_memory=s.expert))


# ------------------------------------------------------------------ ExpertCache
SHAPES = ((4, 2), (4, 2), (2, 4))
SLOT_BYTES = 3 * 8 * 4


def make_cache(slots: int, policy=None, budget: MemoryBudget | None = None) -> ExpertCache:
    budget = budget or MemoryBudget("gpu", None)

    def alloc(shape, dtype, what):
        budget.reserve(int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(), what)
        return torch.empty(shape, dtype=dtype)

    return ExpertCache(slots, SHAPES, torch.float32, alloc, policy)


def fill(cache: ExpertCache, key, pinned=frozenset()):
    slot = cache.claim(key, set(pinned))
    assert slot is not None
    for t in slot:
        t.fill_(hash(key) % 97)
    return slot


def test_cache_allocates_slots_against_budget():
    b = MemoryBudget("gpu", 3 * SLOT_BYTES)
    cache = make_cache(3, budget=b)
    assert cache.num_slots == 3 and cache.slot_bytes == SLOT_BYTES and b.used == 3 * SLOT_BYTES
    with pytest.raises(BudgetError, match="expert cache slot"):
        make_cache(1, budget=b)


def test_lru_eviction_order():
    cache = make_cache(3, LRUPolicy())
    for k in ["a", "b", "c"]:
        assert cache.lookup(k) is None
        fill(cache, k)
    assert cache.stats.evictions == 0
    assert cache.lookup("a") is not None  # a is now the most recent; b the least
    fill(cache, "d")
    assert "b" not in cache and {"a", "c", "d"} <= set(cache.where)
    fill(cache, "e")  # next least recent: c
    assert "c" not in cache
    cache.lookup("a")
    fill(cache, "f")  # d (a was just used)
    assert set(cache.where) == {"a", "e", "f"}
    assert cache.stats.evictions == 3


def test_evicted_slot_is_reused_in_place():
    cache = make_cache(1)
    s1 = fill(cache, "a")
    s2 = fill(cache, "b")
    assert all(x.data_ptr() == y.data_ptr() for x, y in zip(s1, s2))


def test_hit_miss_counts_and_bytes_in():
    cache = make_cache(2)
    for k in ["a", "b", "a", "c", "a", "b"]:
        if cache.lookup(k) is None:
            fill(cache, k)
    st = cache.stats
    # a miss, b miss, a hit, c miss (evicts b), a hit, b miss (evicts c)
    assert (st.hits, st.misses, st.evictions) == (2, 4, 2)
    assert st.bytes_in == 4 * SLOT_BYTES
    assert st.hit_rate == pytest.approx(2 / 6)


def test_lfu_evicts_least_frequently_used():
    cache = make_cache(3, LFUPolicy())
    for k in ["a", "b", "c"]:
        fill(cache, k)
    for k, n in [("a", 3), ("b", 1), ("c", 2)]:
        for _ in range(n):
            assert cache.lookup(k) is not None
    fill(cache, "d")  # uses: a 4, b 2, c 3
    assert "b" not in cache
    fill(cache, "e")  # d 1 is now the least used
    assert "d" not in cache and {"a", "c", "e"} == set(cache.where)


def test_lfu_ties_broken_by_recency():
    cache = make_cache(2, LFUPolicy())
    fill(cache, "a")
    fill(cache, "b")
    fill(cache, "c")  # a and b used once each; a is older
    assert set(cache.where) == {"b", "c"}


@pytest.mark.parametrize("policy", [LRUPolicy, LFUPolicy])
def test_pinned_keys_never_evicted(policy):
    cache = make_cache(3, policy())
    for k in ["a", "b", "c"]:
        fill(cache, k)
    for _ in range(5):
        cache.lookup("c")  # c is the most valuable for both policies; a the least
    fill(cache, "d", pinned={"a", "d"})  # a is the policy's favourite victim but pinned: b goes
    assert set(cache.where) == {"a", "c", "d"}
    fill(cache, "e", pinned={"a", "c", "e"})  # the only unpinned key is d, however recent
    assert set(cache.where) == {"a", "c", "e"}
    # every key pinned: no slot, nothing evicted
    before = dict(cache.where)
    assert cache.claim("z", pinned=set(cache.where)) is None
    assert cache.where == before and "z" not in cache


def test_zero_slot_cache():
    cache = make_cache(0)
    assert cache.num_slots == 0 and cache.slot_bytes == 0
    assert cache.lookup("a") is None and cache.lookup("a") is None
    assert cache.claim("a", set()) is None
    assert "a" not in cache
    assert (cache.stats.hits, cache.stats.misses, cache.stats.bytes_in, cache.stats.hit_rate) == (0, 2, 0, 0.0)


# ------------------------------------------------------------------ placement
def test_popularity_placement_and_expected_hit_rate():
    rng = np.random.default_rng(0)
    L, E, eb = 4, 8, 1000
    pop = rng.integers(0, 1000, size=(L, E)).astype(float)
    layers = list(range(L))
    # fast tier: 2 cache slots + 5 resident (+ a remainder smaller than one expert); CPU: 10 experts
    pl = plan_expert_placement(layers, E, eb, fast_free=7 * eb + 999, cpu_free=10 * eb + 5, popularity=pop,
                               cache_slots=2)
    order = sorted(((l, e) for l in layers for e in range(E)), key=lambda k: -pop[k])
    assert pl.cache_slots == 2 and pl.expert_bytes == eb
    fast = {k for k, t in pl.tiers.items() if t == FAST}
    cpu = {k for k, t in pl.tiers.items() if t == CPU}
    assert fast == set(order[:5])
    assert cpu == set(order[5:15])
    assert pl.count(DISK) == L * E - 15
    # the most popular experts are on faster tiers
    assert min(pop[k] for k in fast) >= max(pop[k] for k in cpu)
    assert min(pop[k] for k in cpu) >= max(pop[k] for k, t in pl.tiers.items() if t == DISK)
    # Fiddler: hit = sum of cnt over fast-resident experts / sum of all cnt
    assert pl.expected_hit_rate == pytest.approx(sum(pop[k] for k in fast) / pop.sum())


def test_placement_without_profile_fills_in_layer_order():
    pl = plan_expert_placement([1, 3], 4, 10, fast_free=10 * 4 + 10 * 3, cpu_free=None, cache_slots=4)
    assert [k for k, t in pl.tiers.items() if t == FAST] == [(1, 0), (1, 1), (1, 2)]
    assert pl.count(CPU) == 0 and pl.count(DISK) == 5  # no CPU tier without an accelerator
    assert pl.expected_hit_rate is None


def test_placement_default_cache_is_at_most_one_layer():
    pl = plan_expert_placement([0, 1], 4, 10, fast_free=10 * 6, cpu_free=0)
    assert pl.cache_slots == 4 and pl.count(FAST) == 2 and pl.count(DISK) == 6
    small = plan_expert_placement([0, 1], 4, 10, fast_free=25, cpu_free=0)
    assert small.cache_slots == 2 and small.count(FAST) == 0


def test_placement_rejects_cache_that_does_not_fit():
    with pytest.raises(BudgetError, match="3 cache slots need"):
        plan_expert_placement([0], 8, 100, fast_free=250, cpu_free=None, cache_slots=3)


def test_kv_cache_reserved_before_it_is_allocated(rt, monkeypatch):
    """The KV cache's bytes are checked against the budget before the tensors exist, and a KV cache
    that does not fit raises BudgetError without allocating."""
    import tiered.engine.llm as llm_mod

    events = []
    real_kv, real_reserve = llm_mod.KVCache, MemoryBudget.reserve

    def kv(*a, **k):
        events.append("alloc")
        return real_kv(*a, **k)

    def reserve(self, nbytes, what=""):
        real_reserve(self, nbytes, what)
        if what == "the KV cache":
            events.append("reserve")

    s = rt.sizes("olmoe")
    llm = LLM(rt.dir("olmoe"), engine_config(accelerator="none", cpu_memory=s.fast(cache_slots=2, accelerator=False),
                                             expert_cache_slots=2))
    try:
        monkeypatch.setattr(llm_mod, "KVCache", kv)
        monkeypatch.setattr(MemoryBudget, "reserve", reserve)
        llm.logits(prompt(8))
        assert events == ["reserve", "alloc"]
        used = llm.cpu_budget.used
        events.clear()
        with pytest.raises(BudgetError, match="the KV cache"):
            llm.kv_cache(3)  # a server's 3 slots: 3x the room
        assert events == [] and llm.cpu_budget.used == used
        # generate() of 3 prompts takes the slots that fit and queues the rest (LLM._batch_slots)
        outs = llm.generate([prompt(8), prompt(8, seed=1), prompt(8, seed=2)], GREEDY)
        assert len(outs) == 3 and events == ["reserve", "alloc"]
    finally:
        llm.experts.executor.close()


def _anon_huge_kib() -> int:
    """This process's resident anonymous memory on transparent huge pages [KiB]."""
    return int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process holding address `addr` (/proc/self/smaps):
    "hg" marks a range madvised MADV_HUGEPAGE."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_large_host_tensors_sit_on_huge_pages(monkeypatch):
    """A large host tensor from the budget starts on a 2 MiB boundary and its whole 2 MiB runs, and
    only those, are advised as transparent huge pages (its tail is not: nothing beyond its own bytes
    becomes resident); where the kernel grants them (it may not, when RAM is fragmented), they are
    huge pages. Small or pinned ones and TIERED_HUGEPAGES=0 get torch.empty. The budget counts the
    tensor's bytes either way."""
    import sys

    from tiered.hardware.budget import HUGE_PAGE, HUGE_PAGES_FROM, huge_pages_enabled

    if not sys.platform.startswith("linux") or not huge_pages_enabled():
        pytest.skip("transparent huge pages are Linux-only")
    b = MemoryBudget("cpu", None)
    t = b.empty((5 * HUGE_PAGE // 8 + 512,), torch.float32, "experts")  # 5 MiB + 2 KiB: two full 2 MiB runs
    assert b.used == t.numel() * 4 and t.data_ptr() % HUGE_PAGE == 0 and t.is_contiguous()
    before = _anon_huge_kib()
    t.fill_(1.5)  # first touch: the pages become resident
    grown = _anon_huge_kib() - before
    assert t.sum().item() == 1.5 * t.numel()
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    end = t.data_ptr() + t.numel() * 4
    assert "hg" in _vm_flags(t.data_ptr()) and "hg" in _vm_flags(t.data_ptr() + 2 * HUGE_PAGE - 1)
    assert "hg" not in _vm_flags(end - 1)  # the tail (1 MiB + 2 KiB) was not advised
    if "[madvise]" in mode:  # only what asked for them: at most the full runs, never the tail
        assert grown in (0, HUGE_PAGE // 1024, 2 * HUGE_PAGE // 1024)
    # a small one is torch.empty's, no huge mapping of its own (neither this process's AnonHugePages nor
    # the heap's VmFlags witness it in a long run: khugepaged collapsed t's advised runs between two reads
    # once in CI, and an earlier madvise had left the heap flagged "hg" in another)
    from tiered.hardware import budget as budget_module

    def no_mapping(n):
        raise AssertionError(f"a {n}-byte tensor got a huge-page mapping")
    monkeypatch.setattr(budget_module, "huge_mapping", no_mapping)
    small = b.empty((HUGE_PAGES_FROM // 4 - 1,), torch.float32)
    small.fill_(1.0)
    monkeypatch.undo()
    monkeypatch.setenv("TIERED_HUGEPAGES", "0")
    plain = b.empty((HUGE_PAGES_FROM,), torch.uint8)
    assert plain.numel() == HUGE_PAGES_FROM and b.used == t.numel() * 4 + small.numel() * 4 + plain.numel()


def test_locked_host_tensors_are_unlocked_when_their_last_view_dies(monkeypatch):
    """host_empty(lock=...) (CudaAccelerator.host_buffer's cudaHostRegister): the lock sees the
    tensor's 2 MiB-aligned start and its bytes rounded up to whole pages, once; the unlock runs when
    the last view is freed, not before; a refused lock, a small tensor or TIERED_HUGEPAGES=0 gives
    None (the caller falls back to its own pinned allocator)."""
    import gc
    import mmap
    import sys

    from tiered.hardware.budget import HUGE_PAGE, HUGE_PAGES_FROM, host_empty, huge_pages_enabled

    if not sys.platform.startswith("linux") or not huge_pages_enabled():
        pytest.skip("transparent huge pages are Linux-only")
    locked, unlocked = [], []

    def lock(address, nbytes):
        locked.append((address, nbytes))
        return lambda: unlocked.append(address)
    t = host_empty((HUGE_PAGES_FROM + 10,), torch.uint8, lock=lock)
    assert locked == [(t.data_ptr(), -(-(HUGE_PAGES_FROM + 10) // mmap.PAGESIZE) * mmap.PAGESIZE)]
    assert t.data_ptr() % HUGE_PAGE == 0
    view = t[100:].view(torch.uint8)
    del t
    gc.collect()
    assert unlocked == []  # a view still holds the memory
    view.fill_(3)
    del view
    gc.collect()
    assert unlocked == [locked[0][0]]
    assert host_empty((HUGE_PAGES_FROM,), torch.uint8, lock=lambda a, n: None) is None  # refused
    assert host_empty((HUGE_PAGES_FROM - 1,), torch.uint8, lock=lock) is None and len(locked) == 1  # small
    monkeypatch.setenv("TIERED_HUGEPAGES", "0")
    assert host_empty((HUGE_PAGES_FROM,), torch.uint8, lock=lock) is None and len(locked) == 1



def test_registered_host_memory_copies_asynchronously(monkeypatch):
    """hardware/cuda.page_locked: a view anywhere inside a range `_register` page-locked counts as pinned
    (its H2D copies are issued non-blocking), also where torch's Tensor.is_pinned() says False (it did
    once on the H100 host, 2026-11-26, in one pytest-xdist worker; True in a plain process); the range is
    forgotten when it is unlocked, and a tensor running past its end does not count. cudart is faked
    here (no CUDA): registration succeeds and unregistration is recorded."""
    import gc
    import sys

    from tiered.hardware import cuda
    from tiered.hardware.budget import HUGE_PAGES_FROM, host_empty, huge_pages_enabled

    if not sys.platform.startswith("linux") or not huge_pages_enabled():
        pytest.skip("transparent huge pages are Linux-only")
    unregistered = []

    class FakeCudart:
        def cudaHostRegister(self, address, nbytes, flags):
            return 0

        def cudaHostUnregister(self, address):
            unregistered.append(address)
            return 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    t = host_empty((HUGE_PAGES_FROM,), torch.uint8, lock=cuda._register)
    start = t.data_ptr()
    assert cuda.page_locked(t) and cuda.page_locked(t[HUGE_PAGES_FROM // 2:]) and cuda.page_locked(t[-1:])
    assert not cuda.page_locked(torch.empty(16))  # ordinary memory
    past = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), HUGE_PAGES_FROM - 8, (4096 + 16,))
    assert not cuda.page_locked(past)  # runs past the locked range (a page beyond it)
    rows = t[: HUGE_PAGES_FROM // 4096 * 4096].view(-1, 4096)
    assert cuda.page_locked(rows[:, :8]) and cuda.page_locked(rows.t())  # strided views inside it
    strided = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), HUGE_PAGES_FROM - 64, (8,), (4096,))
    assert not cuda.page_locked(strided)  # 8 bytes, but spanning 28 KiB past the end
    cpu_copies = []

    class Dst:
        def copy_(self, src, non_blocking=False):
            cpu_copies.append(non_blocking)
    cuda.CudaAccelerator.copy_to_device(None, Dst(), t[:64])
    assert cpu_copies == [True]
    del t, past, rows, strided
    gc.collect()
    assert unregistered == [start] and start not in cuda._LOCKED and start not in cuda._LOCKED_STARTS

def test_weights_the_link_reads_are_the_accelerators_host_buffers(rt, monkeypatch):  # noqa: F811
    """Experts kept in RAM for the link, and the CPU-side slices of a sliced MLP, come from
    Accelerator.host_buffer (pinned memory on CUDA): on the stand-in, huge-page memory."""
    from tiered.hardware.accelerator import HostAccelerator
    from tiered.hardware.budget import HUGE_PAGE, HUGE_PAGES_FROM, huge_pages_enabled
    from tiered.runtime.executor import Executor
    from tiered.runtime.sliced import SlicedMLP

    calls, spans, real = [], [], HostAccelerator.host_buffer

    def spy(self, shape, dtype):
        calls.append(tuple(shape))
        out = real(self, shape, dtype)
        spans.append((out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()))
        return out
    monkeypatch.setattr(HostAccelerator, "host_buffer", spy)
    acc = HostAccelerator()
    big = acc.host_buffer((HUGE_PAGES_FROM,), torch.uint8)
    assert big.data_ptr() % HUGE_PAGE == 0 or not huge_pages_enabled()
    D, F = 16, 64
    w = [torch.randn(F, D), torch.randn(F, D), torch.randn(D, F)]
    ex = Executor(acc)
    try:
        with acc.scope():
            SlicedMLP(*w, 0.5, 0.25, acc, ex)
    finally:
        ex.close()
    assert calls[1:] == [(32, D), (32, D), (D, 32), (16, D), (16, D), (D, 16)]  # CC, then CG parts
    s = rt.sizes("mixtral")
    calls.clear()
    llm = LLM(rt.dir("mixtral"), engine_config(accelerator="host", gpu_memory=s.fast(cache_slots=2),
                                               cpu_memory="64MiB"))
    try:
        host = [t for ts in llm.experts.store.host.values() for t in ts]
        assert host and all(any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi
                                for lo, hi in spans) for t in host)  # each RAM expert in a host buffer (a slab)
        assert all(t.data_ptr() % 4096 == 0 for t in host)  # each on a page of its own
    finally:
        llm.close()


def test_pinned_setting_is_checked():
    from tiered import EngineConfig

    assert EngineConfig().pinned == "auto" and EngineConfig(pinned="cuda").pinned == "cuda"
    with pytest.raises(ConfigError, match="pinned must be"):
        EngineConfig(pinned="4k")


def test_move_to_huge_pages_repoints_a_modules_tensors_into_one_arena(monkeypatch):
    """move_to_huge_pages: a module's torch-allocated storages (from ARENA_FROM bytes) move into one
    huge-page arena, each on a page boundary, with the same values; every tensor viewing one
    (parameter, buffer, a view and its base, a plain tensor attribute) is re-pointed in place, so
    the module's objects stay the same; a storage something outside the module also holds stays
    (both copies would live), as do small ones, skipped attributes and everything under
    TIERED_HUGEPAGES=0."""
    import sys

    from torch import nn

    from tiered.hardware.budget import ARENA_FROM, HUGE_PAGE, HUGE_PAGES_FROM, huge_pages_enabled, move_to_huge_pages

    if not sys.platform.startswith("linux") or not huge_pages_enabled():
        pytest.skip("transparent huge pages are Linux-only")
    n = HUGE_PAGES_FROM // 4 + 1024  # fp32 elements: a large storage
    m = nn.Module()
    m.w = nn.Parameter(torch.randn(n), requires_grad=False)
    buf = torch.randn(2, n)
    m.register_buffer("row", buf[1].view(torch.int32))  # a view (of a view: with a base)
    m.plain = buf[0]  # a plain attribute on the same storage
    m.mid = nn.Parameter(torch.randn(ARENA_FROM // 4 + 3), requires_grad=False)  # small, but in the arena
    m.small = nn.Parameter(torch.randn(16), requires_grad=False)
    m.child = nn.Module()
    m.child.held = nn.Parameter(torch.randn(n), requires_grad=False)
    outside = m.child.held.view(-1)  # held outside the module too
    m.child.skipped = nn.Parameter(torch.randn(n), requires_grad=False)
    want = {k: getattr(m, k).clone() for k in ("w", "row", "plain", "mid")}
    w_obj = m.w
    held_ptr, skipped_ptr, small_ptr = m.child.held.data_ptr(), m.child.skipped.data_ptr(), m.small.data_ptr()
    del buf
    moved = move_to_huge_pages(m, skip=lambda mod, name: name == "skipped")
    assert moved == n * 4 + 2 * n * 4 + m.mid.numel() * 4
    assert m.w is w_obj and isinstance(m.w, nn.Parameter)
    arena = m.w.untyped_storage().data_ptr()
    assert all(getattr(m, k).untyped_storage().data_ptr() == arena for k in want)  # one arena
    assert m.w.data_ptr() % HUGE_PAGE == 0  # the first storage moved opens the 2 MiB-aligned arena
    assert m.plain.data_ptr() % 4096 == 0 and m.mid.data_ptr() % 4096 == 0  # each storage on a page
    for k, v in want.items():
        assert torch.equal(getattr(m, k), v)
    assert (m.child.held.data_ptr(), m.child.skipped.data_ptr(), m.small.data_ptr()) == (held_ptr, skipped_ptr, small_ptr)
    assert outside.data_ptr() == held_ptr
    assert move_to_huge_pages(m) == n * 4  # again: only `skipped` (its own storage) is left to move
    m2 = nn.Module()
    m2.w = nn.Parameter(torch.randn(n), requires_grad=False)
    monkeypatch.setenv("TIERED_HUGEPAGES", "0")
    assert move_to_huge_pages(m2) == 0


def test_host_slab_carves_page_aligned_tensors_until_full():
    from tiered.hardware.budget import HostSlab

    shapes = [(3, 100), (100, 3)]
    slab = HostSlab(HostSlab.bytes_for(2, shapes, torch.float32))
    assert HostSlab.bytes_for(2, shapes, torch.float32) == 2 * 2 * 4096
    got = [slab.take(s, torch.float32) for _ in range(2) for s in shapes]
    assert [tuple(t.shape) for t in got] == shapes * 2 and all(t.data_ptr() % 4096 == 0 for t in got)
    for i, t in enumerate(got):
        t.fill_(i)
    assert [float(t.mean()) for t in got] == [0.0, 1.0, 2.0, 3.0]  # no two overlap
    with pytest.raises(MemoryError, match="full"):
        slab.take((1,), torch.float32)


def _resident_kib(t: torch.Tensor) -> int:
    """KiB of tensor `t`'s bytes (page-aligned) that are resident in RAM, by mincore(2) over its range."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = 4096
    n = -(-t.numel() * t.element_size() // page)
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(n * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page // 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("huge", [False, True])
def test_a_servers_kv_cache_holds_only_the_pages_its_sequences_wrote(dtype, huge):
    """A KV cache of many slots x a long context (a server's) costs the RAM of what was written, not of its whole
    reservation (memory/host.lazy_zeros: torch.zeros had written every byte at startup): nothing is resident before a
    write; a write to slot 0's first 100 positions commits those 4 KiB pages (a server's cache), or at most the 2 MiB
    huge pages around them in each layer (`huge_pages`, a call's cache: advised MADV_HUGEPAGE), and slots 5-11 (from
    2.8 MiB past slot 0's first byte to 2 MiB before the next layer's) stay unwritten. Unwritten positions read 0."""
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.hardware.budget import huge_pages_enabled
    from tiered.models.layers import KVCache

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    cache = KVCache(cfg, 16, 4096, dtype, huge_pages=huge)  # 2 x 4 layers x 16 slots x 2 heads x 4096 positions x 64
    assert cache.nbytes >= 2 * 4 * 16 * 2 * 4096 * 64 * cache.k.element_size()
    assert cache.k.data_ptr() % 4096 == 0 and cache.k.is_contiguous()
    assert _resident_kib(cache.k) == _resident_kib(cache.v) == 0  # nothing resident yet (the kernel's zero pages)
    assert cache.resident_bytes() == 0
    if huge_pages_enabled():  # advised as transparent huge pages (VmFlags "hg") where asked, and only there
        assert ("hg" in _vm_flags(cache.k.data_ptr())) == huge and ("hg" in _vm_flags(cache.v.data_ptr())) == huge
    cache.k[:, 0, :, :100] = 1
    cache.v[:, 0, :, :100] = 2
    resident = _resident_kib(cache.k) + _resident_kib(cache.v)
    # 4 KiB pages: each layer's 2 heads' 100 positions (100 x 128 or 72 bytes: 2-4 pages a head); huge: 3 pages
    assert 0 < resident <= (2 * 4 * 3 * 2048 if huge else 2 * 4 * 2 * 4 * 4) < cache.nbytes // 1024
    assert cache.resident_bytes() == resident * 1024
    for layer in range(4):
        assert _resident_kib(cache.k[layer, 5:12]) == _resident_kib(cache.v[layer, 5:12]) == 0
    assert int(cache.k[:, 0, :, :100].float().sum()) == 4 * 2 * 100 * cache.k.shape[-1]
    assert not cache.k[:, 0, :, 100:].any() and not cache.k[:, 1:].any() and not cache.v[:, 1:].any()
