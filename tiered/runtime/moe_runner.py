"""TieredExperts: the runtime's expert runner — computes a MoE layer's routed experts where the
plan's dispatch says, fetching weights across tiers on the executor's streams.

Per layer and step (dimension legend: N tokens, D hidden, k top-k, E experts):
  1. group the N*k routing slots by expert on the device (one sort) and read the per-expert token
     counts to the host: the layer's only host sync;
  2. experts on the fast tier (resident or cached) compute there; the others ("misses") get a
     path from the dispatcher for the whole layer at once (runtime/dispatcher.split_misses):
       COPY  -> H2D copy on the copy stream into a cache slot or staging buffer, then launched
                from this thread on its own device stream once the copy is done;
       CPU   -> compute with the host copy on the calling thread (torch's OpenMP team belongs to
                it; a worker thread's second team is slower and fights it for the cores);
       SPLIT -> one dense miss in RAM per layer divided by gate/up rows (the others whole, each
                side's load counted in its share): the CPU computes its share of the hidden
                activations on this thread while the link copies the rest and down, then the
                accelerator finishes it (_split);
     a disk-tier expert is read first (pread on reader threads) into a host staging buffer (with an
     accelerator) or into a fast-tier slot (without one, where every miss computes on the CPU);
  3. combine the weighted outputs in expert order (as transformers does: identical sums).
With an accelerator, a layer whose experts are all resident there at full precision (stacked per
layer: ExpertStore.stacks) skips all of that: grouped GEMMs over the stacked weights with the routing
kept on the device (runtime/grouped_experts.py), no host sync, so the decode step can be one CUDA
graph (Plan.decode_graphs).
Without an accelerator, a layer whose experts are all in RAM at full precision (the common CPU
decode step) skips the per-expert tasks: one native call computes every expert of the layer in two
parallel regions (ExpertFormat.forward_group), and one index_add combines them in the same order.
Fast-tier experts are launched from this thread on its current device stream: no worker hop and
no wait. Activations cross to the host only when some expert takes the CPU path, and nothing
waits for the whole device: copies wait, on the device, for an event recorded after the router.
With `read_ahead`, every missing expert's read is issued at once and each expert computes as soon
as its weights land; without it, read -> compute -> read ... in turn.

Experts compute from their stored format (quant/experts.ExpertFormat: bf16, int8 or int4 kernels).
With mixed precision (HOBBIT, ALGORITHMS.md §3; placed.low set), a miss first gets a precision from
the token's router weights (runtime/precision.py: high, low or skip); a low-precision need is met
by a hit in the low pool, else the low copy is loaded (fewer bytes) into the low pool; a skipped
expert's term is dropped. Resident and high-cache experts always serve at high precision.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from tiered.memory.apply import PlacedExperts, StagingPool
from tiered.models.moe import swiglu_hidden
from tiered.planner.placement import DISK
from tiered.quant.experts import bf16_native_rows
from tiered.runtime.dispatcher import COPY, CPU, RESIDENT, SPLIT, LatencyModel, dispatch_misses
from tiered.runtime.executor import Executor
from tiered.runtime.grouped_experts import grouped_experts_forward, grouped_method
from tiered.runtime.precision import HIGH, NAMES, SKIP


@dataclass
class _Side:
    """One precision's copies: its format, home store, fast-tier cache and view of a staging buffer."""

    fmt: object  # quant/experts.ExpertFormat
    store: object  # memory/expert_store.ExpertStore
    cache: object  # memory/expert_cache.ExpertCache
    view: Callable
    issue_copies: bool = False  # misses' H2D copies from the home copies issued on the layer's thread


def _same(buffers):
    return buffers


# Routed (token, expert) entries up to which a CPU-only layer of resident experts takes one native
# call (TieredExperts._resident_layer): a decode step's, up to 8 sequences at top-8.
LAYER_CALL_ENTRIES = 64


class TieredExperts:
    """Expert runner over tiers (an ExpertRunner, see models/moe.py).

    Args:
        placed: the experts as memory/apply.place_experts built them (store, cache, staging).
        executor: streams for disk reads, H2D copies, CPU and accelerator compute ("cpu" inline).
        latency: the plan's dispatch latency model (None without an accelerator).
        accelerator: Accelerator or None (the fast tier is then CPU RAM and compute is on the CPU).
        dispatch_mode: the plan's "balanced", "priced", "per-expert", "copy", "cpu" or "split".
        read_ahead: issue all of a layer's expert reads at once.
        group_layers: the plan's native_decode: without an accelerator, a layer whose experts are
            all in RAM computes them in one native call (_all_on_fast).
        device_issue: the plan's Plan.device_issue: "thread" issues a miss's H2D copy from page-locked
            memory on the layer's own thread before its CPU experts run (Executor.issue), where
            nothing it waits for is pending; "worker" leaves every copy to the copy stream's worker.
    Attributes:
        path_counts: Counter of paths over all dispatched experts; bytes_read: disk bytes read;
        bytes_h2d: bytes copied to the accelerator; resident_hits: uses of fast-resident experts
        (the cache's own stats count only its slots); host_syncs: layers whose activations crossed
        to the host for CPU experts; precision_counts (mixed precision): misses loaded "high" or
        "low", "skip"ped, and low needs met by a "low hit" in the low pool.
    """

    def __init__(self, placed: PlacedExperts, executor: Executor, latency: LatencyModel | None, accelerator,
                 dispatch_mode: str = "balanced", read_ahead: bool = True, group_layers: bool = False,
                 device_issue: str = "thread") -> None:
        self.store, self.cache = placed.store, placed.cache
        self.fast_staging, self.host_staging = placed.fast_staging, placed.host_staging
        self.executor, self.latency, self.accelerator = executor, latency, accelerator
        self.dispatch_mode, self.read_ahead = dispatch_mode, read_ahead
        self.group_layers = group_layers and accelerator is None
        # layers whose every expert is resident (the placement is fixed): _resident_layer's, one precision only
        self._layer_calls: set[int] = set()
        if self.group_layers and placed.low is None:
            by_layer: dict[int, list] = {}
            for key in placed.store.placement.tiers:
                by_layer.setdefault(key[0], []).append(key)
            self._layer_calls = {l for l, keys in by_layer.items() if all(k in placed.store.resident for k in keys)}
        self.path_counts: Counter = Counter()
        self.bytes_read = 0
        self.bytes_h2d = 0
        self.resident_hits = 0
        self.host_syncs = 0
        self._pinned: set = set()
        self.prefetcher = None
        self.num_experts = placed.store.num_experts
        self.fmt = placed.store.fmt  # computes an expert from its stored (maybe quantized) form
        def issue_copies(store) -> bool:
            # whether misses' copies from this store's home copies in RAM are issued on the layer's thread
            # (Executor.issue): device_issue "thread" and every home copy page-locked, known once at install
            return device_issue == "thread" and accelerator is not None and all(
                accelerator.page_locked(t) for w in store.host.values() for t in w)
        self.high = _Side(placed.store.fmt, placed.store, placed.cache, _same, issue_copies(placed.store))
        low = placed.low
        self.low = None if low is None else _Side(low.store.fmt, low.store, low.cache, low.view,
                                                  issue_copies(low.store))
        self.mixed = None if low is None else low.mixed
        self.precision_counts: Counter = Counter()  # misses by precision: high / low loads, skips; low hits
        self.one_token_path = True  # _one_token_on_fast for a decode token whose experts are all on the GPU
        # layers whose experts are all resident on the accelerator, stacked: grouped GEMMs, no host sync
        # (not gpt-oss's biased clamped-GLU experts: grouped_experts computes SwiGLU)
        self.grouped = accelerator is not None and low is None and self.fmt.swiglu_limit is None

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 block) -> torch.Tensor:
        t_layer = time.perf_counter()
        stack = self.store.stacks.get(layer_idx) if self.grouped and self.prefetcher is None else None
        if stack is not None and stack[0].dtype == x.dtype:  # (experts stored in another dtype: general path)
            method = grouped_method(x, topk_idx.numel())
            if method is not None:
                return self._grouped(layer_idx, x, topk_idx, topk_weight, stack, method, t_layer)
        if layer_idx in self._layer_calls and topk_idx.numel() <= LAYER_CALL_ENTRIES:
            out = self._resident_layer(layer_idx, x, topk_idx, topk_weight, t_layer)
            if out is not None:
                return out
        k = topk_idx.shape[1]
        flat = topk_idx.flatten()  # (N*k,)
        t_sync = time.perf_counter()
        ids = None
        if x.shape[0] == 1 and self.mixed is None:  # one token: its k experts, read once (no bincount)
            ids = flat.tolist()  # the one host sync
            counts, needs = [0] * self.num_experts, None
            for e in ids:
                counts[e] += 1
        elif self.mixed is None:
            counts, needs = torch.bincount(flat, minlength=self.num_experts).tolist(), None  # the one host sync
        else:  # HOBBIT Eq. 2 per slot -> highest precision per expert, in the same sync
            counts_t = torch.bincount(flat, minlength=self.num_experts)  # (E,)
            counts, needs = torch.stack([counts_t, self.mixed.expert_needs(topk_idx, topk_weight, self.num_experts)]).tolist()
        self.executor.record(f"host sync L{layer_idx}", "main", t_sync, time.perf_counter(), layer=layer_idx)
        groups, start = {}, 0
        for e, c in enumerate(counts):
            if c:
                groups[e] = (start, start + c)
                start += c
        keys = {e: (layer_idx, e) for e in groups}
        self._pinned = set(keys.values())
        self.cache.begin_layer(layer_idx, x.shape[0])
        if self.low is not None:
            self.low.cache.begin_layer(layer_idx, x.shape[0])
        if self.prefetcher is not None:
            self.prefetcher.on_layer(layer_idx, x, list(groups), self._pinned)
        on_fast = {e: self._weights_on_fast(keys[e]) for e in groups}
        misses = [e for e in groups if on_fast[e] is None]
        side = {e: self.high for e in groups}
        if needs is not None:
            misses = self._choose_precision(misses, needs, keys, on_fast, side, groups)
        if (ids is not None and self.one_token_path and not misses and self.accelerator is not None
                and self.prefetcher is None and all(side[e] is self.high for e in groups)):
            out = self._one_token_on_fast(ids, x, topk_weight, on_fast, side)
            self.executor.record(f"moe layer {layer_idx}", "main", t_layer, time.perf_counter(), layer=layer_idx)
            return out
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, token order within
        tok_all, slot_all = order // k, order % k  # (N*k,) token row and top-k slot of each entry
        if self.group_layers and not misses and all(side[e] is self.high for e in groups):
            out = self._all_on_fast(layer_idx, x, groups, keys, on_fast, tok_all, slot_all, topk_idx, topk_weight)
            if out is not None:
                self.executor.record(f"moe layer {layer_idx}", "main", t_layer, time.perf_counter(), layer=layer_idx)
                return out
        shares: dict = {}
        if self.accelerator is None:
            paths = {e: "disk" for e in misses}
        else:
            can_split = {e: self._splittable(keys[e], side[e]) for e in misses}
            chosen = dispatch_misses([counts[e] for e in misses], self.latency, self.store.expert_bytes,
                                     self.dispatch_mode, splittable=all(can_split.values()))
            # (a forced split of an expert that cannot be split runs on the CPU)
            paths = {e: CPU if p == SPLIT and not can_split[e] else p for e, p in zip(misses, chosen.paths)}
            shares = dict(zip(misses, chosen.shares))
        if self.read_ahead:
            for e in misses:
                if side[e].store.tier(keys[e]) == DISK:
                    side[e].store.advise(keys[e])
        host = None
        if any(p in (CPU, SPLIT) for p in paths.values()):  # activations and token rows cross once per layer
            t_d2h = time.perf_counter()
            host = (self.accelerator.to_host(x), self.accelerator.to_host(tok_all))
            self.host_syncs += 1
            self.executor.record(f"d2h L{layer_idx}", "main", t_d2h, time.perf_counter(), layer=layer_idx)
        ready = self.accelerator.record_event() if self.accelerator is not None else None
        # CPU-path experts are submitted (and so run, on this thread) first: the copies and launches
        # submitted after them proceed on the streams meanwhile. Inline tasks run in submission
        # order and every dependency points to an earlier task, so no task waits on one that waits on it.
        order = sorted(groups, key=lambda e: (paths.get(e) not in (CPU, SPLIT), e))
        results: dict[int, Future] = {}
        for e in order:
            a, b = groups[e]
            tok = tok_all[a:b]
            if on_fast[e] is not None:
                self.path_counts[RESIDENT] += 1
                results[e] = self._on_fast(keys[e], on_fast[e], x, tok, ready, side[e])
            else:
                self.path_counts[paths[e]] += 1
                results[e] = self._miss(keys[e], paths[e], x, tok, host and host[1][a:b], host and host[0], ready,
                                        side[e], shares.get(e))
            if not self.read_ahead:
                results[e].result()
        try:
            for e in order:
                results[e].result()
        except BaseException:
            _drain(results[e] for e in order)  # inline tasks run (or fail) so no worker waits on them forever
            raise
        out = torch.zeros_like(x)
        for e, (a, b) in groups.items():  # expert order, like transformers' index_add loop
            tok = tok_all[a:b]
            y = results[e].result()
            if y.device != x.device:
                y = self.accelerator.to_device(y)
            out.index_add_(0, tok, y * topk_weight[tok, slot_all[a:b], None].to(y.dtype))
        self.executor.record(f"moe layer {layer_idx}", "main", t_layer, time.perf_counter(), layer=layer_idx)
        return out

    def _resident_layer(self, layer_idx, x, topk_idx, topk_weight, t_layer) -> torch.Tensor | None:
        """A decode-sized CPU-only layer whose routed experts are all resident in RAM: routing read
        once to the host, then the experts and their weighted sum in one native call
        (ExpertFormat.layer_call), where the general path below spends ~15 small torch ops
        (argsort, bincount, gathers, index_add_: ~0.13 ms per layer on 2 cores, against ~0.03 ms
        here). Same result bit for bit, same counters and trace spans. Only for layers in
        _layer_calls (every expert resident). None, with nothing counted, when one expert has more
        than the format's native_rows or the call cannot take the layer: the general path then runs it."""
        flat = topk_idx.flatten().tolist()  # the one host sync
        experts = sorted(set(flat))
        if max(map(flat.count, experts)) > self.fmt.native_rows:
            return None
        keys = [(layer_idx, e) for e in experts]
        resident = self.store.resident
        call = self.fmt.layer_call(x, [resident[key] for key in keys])
        if call is None:
            return None
        self.executor.record(f"host sync L{layer_idx}", "main", t_layer, time.perf_counter(), layer=layer_idx)
        self._pinned = set(keys)
        self.cache.begin_layer(layer_idx, x.shape[0])
        if self.prefetcher is not None:
            self.prefetcher.on_layer(layer_idx, x, experts, self._pinned)
        self.resident_hits += len(experts)
        self.path_counts[RESIDENT] += len(experts)
        t0 = time.perf_counter()
        out = call(topk_idx, topk_weight, experts)
        t1 = time.perf_counter()
        self.executor.record(f"experts L{layer_idx} ({len(experts)})", "cpu", t0, t1, layer=layer_idx)
        self.executor.record(f"moe layer {layer_idx}", "main", t_layer, t1, layer=layer_idx)
        return out

    def _all_on_fast(self, layer_idx, x, groups, keys, on_fast, tok_all, slot_all, topk_idx,
                     topk_weight) -> torch.Tensor | None:
        """A CPU-only layer whose experts are all on the fast tier (RAM) at full precision: every
        expert and their weighted sum in one native call (ExpertFormat.layer_call: two parallel regions
        for the layer, no task, gather, new tensor or index_add per expert), summed as the per-expert
        path sums them (expert, then token order: identical sums). A prompt's experts with more rows than
        the grouped kernels take (ExpertFormat.group_rows) run `forward` one by one on this thread first,
        their outputs `given` to the call. On 2 Sapphire Rapids cores (2026-12-03, alternated rounds, the
        same tokens) a Qwen3-30B-A3B-width Q4_0 prompt of 512 / 1024 tokens took 0.92x / 0.87x the time of
        the grouped call with the gather, products and index_add in torch (each a new 32-64 MB tensor a
        layer, faulted in), which still runs where the layer call cannot (no native kernel for the format,
        skipped low-precision experts), with the experts past the group rows into the same rows. None when
        neither can take this layer: one task per expert then."""
        experts = list(groups)  # ascending: the rows of tok_all in expert order
        if not experts:
            return None
        if self.prefetcher is not None:  # cached experts still landing from a prefetch
            for e in experts:
                for f in self.prefetcher.loading(keys[e]):
                    f.result()
        t0 = time.perf_counter()
        bounds = [0]
        for e in experts:
            bounds.append(bounds[-1] + groups[e][1] - groups[e][0])
        call = self.fmt.layer_call(x, [on_fast[e] for e in experts]) if bounds[-1] == tok_all.numel() else None
        if call is not None:
            # the experts past the call's rows that it does not compute on the AMX GEMM first, each by itself on this
            # thread; then the others and the weighted sum of all in one native call (no gathered rows, outputs or
            # products as new tensors: 3 x 32 MB a layer at 512 tokens of a Qwen3-30B-A3B-width model, each mapped and
            # faulted in). With the AMX GEMM the call computes the experts past the group rows too, as `forward` does:
            # a Qwen3-30B-A3B-width 512-token prompt's ~85 such experts a layer had cost ~0.25 ms each in torch ops
            # around their GEMMs (2 AMX cores, 2026-12-06)
            most = self.fmt.layer_call_rows
            given = [None] * len(experts)
            for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
                if b - a > most:
                    given[i] = self.fmt.forward(x[tok_all[a:b]], on_fast[experts[i]])
            out = call(topk_idx, topk_weight.to(x.dtype), experts, given, self.fmt.amx_rows)
            self.path_counts[RESIDENT] += len(experts)
            self.executor.record(f"experts L{layer_idx} ({len(experts)})", "cpu", t0, time.perf_counter(), layer=layer_idx)
            return out
        if bounds[-1] < tok_all.numel():  # skipped experts (mixed precision) left their rows out
            rows = torch.cat([torch.arange(*groups[e], device=tok_all.device) for e in experts])
            tok_all, slot_all = tok_all[rows], slot_all[rows]
        xs, limit = x[tok_all], self.fmt.group_rows
        big = [i for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if b - a > limit]
        if not big:
            # every expert's rows in the formats of the step's tokens, as the native step's layer call (above) takes them
            ys = self.fmt.forward_group(xs, [on_fast[e] for e in experts], bounds, x.shape[0])
        elif len(big) == len(experts):
            return None
        else:  # the experts within the call's rows in one call, then each of the others by itself
            small = sorted(set(range(len(experts))) - set(big))
            rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in small])
            part = [0]
            for i in small:
                part.append(part[-1] + bounds[i + 1] - bounds[i])
            ys_small = self.fmt.forward_group(xs[rows], [on_fast[experts[i]] for i in small], part, x.shape[0])
            if ys_small is not None:
                ys = torch.empty_like(xs)
                ys[rows] = ys_small
                for i in big:
                    a, b = bounds[i], bounds[i + 1]
                    ys[a:b] = self.fmt.forward(xs[a:b], on_fast[experts[i]])
            else:
                ys = None
        if ys is None:
            return None
        self.path_counts[RESIDENT] += len(experts)
        out = torch.zeros_like(x)
        out.index_add_(0, tok_all, ys * topk_weight[tok_all, slot_all, None].to(ys.dtype))
        self.executor.record(f"experts L{layer_idx} ({len(experts)})", "cpu", t0, time.perf_counter(), layer=layer_idx)
        return out

    def _choose_precision(self, misses, needs, keys, on_fast, side, groups) -> list[int]:
        """HOBBIT's Dynamic Expert Loader for this layer's misses: a low-pool hit serves a low need,
        a skipped expert leaves `groups` (its term is dropped), the others load at their need.
        Returns the experts still to load; fills `on_fast` (low hits) and `side` (low loads)."""
        out = []
        for e in misses:
            need, key = needs[e], keys[e]
            if need != HIGH and key in self.low.store.handles:
                w = self.low.cache.lookup(key)
                if w is not None:
                    on_fast[e], side[e] = w, self.low
                    self.precision_counts["low hit"] += 1
                    continue
            self.precision_counts[NAMES[need]] += 1
            if need == SKIP:
                del groups[e]
                continue
            if need != HIGH:
                side[e] = self.low
            out.append(e)
        return out

    def _grouped(self, layer_idx, x, topk_idx, topk_weight, stack, method: str, t_layer: float) -> torch.Tensor:
        """A layer whose every expert is resident on the accelerator, stacked (ExpertStore.stacks):
        computed with no host sync (runtime/grouped_experts.py), so a decode step of such layers
        can be one CUDA graph. Every routing slot counts as a resident use (N*k: a decode token's k
        experts; a prompt's are counted per token, not per distinct expert)."""
        self.cache.begin_layer(layer_idx, x.shape[0])
        self.resident_hits += topk_idx.numel()
        self.path_counts[RESIDENT] += topk_idx.numel()
        out = grouped_experts_forward(x, topk_idx, topk_weight, *stack, method=method)
        self.executor.record(f"moe layer {layer_idx} ({method})", "main", t_layer, time.perf_counter(), layer=layer_idx)
        return out

    def _one_token_on_fast(self, ids: list[int], x, topk_weight, on_fast, side) -> torch.Tensor:
        """One token (x [1, D]) whose routed experts `ids` (its top-k, slot order) are all on the
        accelerator: each expert launched here, on the current stream, and their weighted sum, in
        ascending expert order as the general path's index_add_ sums them (same values). A GPU
        decode step's MoE layer is host-bound: this skips the argsort, the per-expert tasks and
        events, the gathers and the index_add_ (about 20 launches and 2 event records per layer)."""
        out = None
        for e, w in on_fast.items():  # the layer's experts, ascending (the general path's groups)
            self.path_counts[RESIDENT] += 1
            y = side[e].fmt.forward(x, w)
            for j, routed in enumerate(ids):  # top-k holds an expert once; a repeat would add again
                if routed == e:
                    wy = y * topk_weight[:, j, None].to(y.dtype)
                    out = wy if out is None else out + wy
        return out

    def _weights_on_fast(self, key):
        w = self.store.resident.get(key)
        if w is not None:
            self.resident_hits += 1
            return w
        return self.cache.lookup(key)

    @property
    def placement(self):
        """The experts' home tiers (the store's ExpertPlacement, as the plan set it)."""
        return self.store.placement

    @property
    def fast_hit_rate(self) -> float:
        """Share of expert uses served from the fast tier: resident experts plus cache hits."""
        st = self.cache.stats
        n = self.resident_hits + st.hits + st.misses
        return (self.resident_hits + st.hits) / n if n else 0.0

    def _compute_stream(self) -> str:
        """Fast-tier experts: launched from this thread on its current device stream (no worker hop,
        no wait), or computed here on the CPU when the fast tier is RAM."""
        return "launch" if self.accelerator is not None else "cpu"

    def _on_fast(self, key, w, x, tok, ready, side: _Side) -> Future:
        layer, e = key
        deps = self.prefetcher.loading(key, side is self.low) if self.prefetcher is not None else ()  # still landing
        return self.executor.submit(self._compute_stream(), lambda: side.fmt.forward(x[tok], w), deps=deps,
                                    name=f"expert L{layer}E{e}", layer=layer, expert=e)

    def _read(self, key, into, deps, side: _Side) -> Future:
        layer, e = key
        store = side.store
        self.bytes_read += store.expert_bytes
        return self.executor.submit("disk", lambda: store.read(key, into), deps=deps, name=f"read L{layer}E{e}",
                                    nbytes=store.expert_bytes, layer=layer, expert=e)

    def _miss(self, key, path: str, x, tok, tok_host, x_host, ready, side: _Side, share: float | None = None) -> Future:
        ex, (layer, e) = self.executor, key
        store, fmt = side.store, side.fmt
        on_disk = store.tier(key) == DISK
        if self.accelerator is None:  # fast tier is RAM: read from disk into a slot, compute on the CPU
            slot, dep, idx = self._slot_or_staging(key, self.fast_staging, side)
            read = self._read(key, slot, [dep] if dep else [], side)
            fut = ex.submit("cpu", lambda: fmt.forward(x[tok], slot), deps=[read], name=f"expert L{layer}E{e}",
                            layer=layer, expert=e)
            if idx is not None:
                self.fast_staging.release_after(idx, fut)
            return fut
        if path == SPLIT:
            return self._split(key, x, tok, tok_host, x_host, ready, side, share)
        deps, host_w, host_idx = [], store.host.get(key), None
        if on_disk:
            buf, dep, host_idx = self.host_staging.take()
            host_w = side.view(buf)
            deps = [self._read(key, host_w, [dep] if dep else [], side)]
        if path == CPU:
            fut = ex.submit("cpu", lambda: fmt.forward(x_host[tok_host], host_w), deps=deps,
                            name=f"cpu expert L{layer}E{e}", layer=layer, expert=e)
        else:
            assert path == COPY
            slot, dep, idx = self._slot_or_staging(key, self.fast_staging, side)
            # the copy waits (on the device) for all work issued before this layer: an evicted slot
            # may still be read by a kernel launched for an earlier layer. It is issued here only from
            # the expert's home copy: a host staging buffer that a disk read filled goes to the next
            # read once this expert's launch has run, which an issued copy does not wait for
            copy = ex.submit("copy", lambda: [self.accelerator.copy_to_device(d, s) for d, s in zip(slot, host_w)],
                             deps=deps + ([dep] if dep else []), name=f"h2d L{layer}E{e}",
                             nbytes=store.expert_bytes, layer=layer, expert=e, after_event=ready,
                             issue_here=not on_disk and side.issue_copies)
            self.bytes_h2d += store.expert_bytes
            fut = ex.submit("launch", lambda: fmt.forward(x[tok], slot), deps=[copy],
                            name=f"expert L{layer}E{e}", layer=layer, expert=e)
            if idx is not None:
                self.fast_staging.release_after(idx, fut)
        if host_idx is not None:
            self.host_staging.release_after(host_idx, fut)
        return fut

    def _splittable(self, key, side: _Side) -> bool:
        """A miss can be SPLIT: dense weights in CPU RAM (not on disk), an accelerator, one precision."""
        return (self.accelerator is not None and self.low is None and side.fmt.is_dense and key in side.store.host
                and side.fmt.swiglu_limit is None)  # (a split computes SwiGLU rows)

    def _split(self, key, x, tok, tok_host, x_host, ready, side: _Side, share: float | None) -> Future:
        """A missing expert split by rows between the CPU and the link (dispatcher SPLIT; ScheInfer's
        CC/CG split of one FFN, ALGORITHMS.md 1.a): the CPU computes the hidden activations of the
        first r gate/up rows on this thread (inline "cpu" task, tiered's bf16 GEMV where built),
        while the copy stream moves the other rows and the whole down projection into a staging
        buffer (not a cache slot: the expert is not whole there); then the accelerator computes its
        rows, joins the CPU's hidden activations (a small H2D) and applies down. r comes from the
        dispatcher's `share` (dispatch_misses: both sides finish together, counting the layer's
        whole CPU experts and copies), rounded to SPLIT_ROW_ALIGN rows; half without one."""
        ex, acc, (layer, e) = self.executor, self.accelerator, key
        gate, up, down = side.store.host[key]
        F_rows = gate.shape[0]
        share = 0.5 if share is None else share
        r = split_rows_of(F_rows, share)
        buf, dep, idx = self.fast_staging.take()
        slot = side.view(buf)
        parts = [(slot[0][r:], gate[r:]), (slot[1][r:], up[r:]), (slot[2], down)] if r < F_rows else [(slot[2], down)]
        nbytes = sum(src.numel() * src.element_size() for _, src in parts)
        copy = ex.submit("copy", lambda: [acc.copy_to_device(d, src) for d, src in parts], deps=[dep] if dep else [],
                         name=f"h2d split L{layer}E{e}", nbytes=nbytes, layer=layer, expert=e, after_event=ready,
                         issue_here=side.issue_copies)
        self.bytes_h2d += nbytes
        x_rows = x_host[tok_host]
        cpu = ex.submit("cpu", lambda: swiglu_rows(x_rows, gate[:r], up[:r]), name=f"cpu split L{layer}E{e}",
                        layer=layer, expert=e)

        def accelerator_part():
            xs = x[tok]
            h = acc.to_device(cpu.result())  # (n, r)
            if r < F_rows:
                h = torch.cat([h, swiglu_hidden(xs, slot[0][r:], slot[1][r:])], -1)  # (n, F)
            w = slot[2] if slot[2].dtype == xs.dtype else slot[2].to(xs.dtype)
            return torch.nn.functional.linear(h, w)
        # the CPU part first (this thread), then the copy's wait: both sides run at once
        fut = ex.submit("launch", accelerator_part, deps=[cpu, copy], name=f"expert split L{layer}E{e}",
                        layer=layer, expert=e)
        if idx is not None:
            self.fast_staging.release_after(idx, fut)
        return fut

    def _slot_or_staging(self, key, staging: StagingPool, side: _Side):
        """A slot of `side`'s cache for `key`, or a staging buffer (viewed for `side`, with the future
        it must wait for) when none is free."""
        slot = side.cache.claim(key, pinned=self._pinned)
        if slot is not None:
            return slot, None, None
        buf, dep, idx = staging.take()
        return side.view(buf), dep, idx


# A SPLIT's CPU rows are a multiple of this (whole cache lines of the GEMV's output and SIMD tiles).
SPLIT_ROW_ALIGN = 64


def split_rows_of(F: int, share: float) -> int:
    """Rows of F that a SPLIT's CPU part takes for `share` in (0, 1]: a multiple of SPLIT_ROW_ALIGN
    (or F), at least one alignment unit."""
    if F <= SPLIT_ROW_ALIGN:
        return F
    r = int(round(share * F / SPLIT_ROW_ALIGN)) * SPLIT_ROW_ALIGN
    return min(F, max(SPLIT_ROW_ALIGN, r))


def swiglu_rows(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ w_gate.T) * (x @ w_up.T): x [n, D], w_gate / w_up [r, D] (rows of an expert) -> [n, r]
    in x's dtype. On the CPU, bf16 rows take tiered's bf16 GEMV (fp32 out) where it is built and the
    rows are contiguous and no more than this machine's tuning gives the native kernel
    (quant/experts.bf16_native_rows); otherwise models/moe.swiglu_hidden."""
    ext = None
    if (x.device.type == "cpu" and w_gate.dtype == torch.bfloat16 and x.shape[0] <= bf16_native_rows()
            and w_gate.is_contiguous() and w_up.is_contiguous()):
        from tiered import kernels
        ext = kernels.load()
    if ext is not None:
        g, u = ext.bf16_kernel(w_gate)(x), ext.bf16_kernel(w_up)(x)  # fp32 (n, r)
        return (torch.nn.functional.silu(g) * u).to(x.dtype)
    return swiglu_hidden(x, w_gate, w_up)


def _drain(futures) -> None:
    """Wait for every future, ignoring their errors (the first error is already being raised)."""
    for f in futures:
        try:
            f.result()
        except BaseException:
            pass
