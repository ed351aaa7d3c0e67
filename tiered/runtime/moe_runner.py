"""TieredExperts: the runtime's expert runner — computes a MoE layer's routed experts where the
dispatcher says, fetching weights across tiers on the executor's streams.

Per layer and step (dimension legend: N tokens, D hidden, k top-k, E experts):
  1. count tokens per expert; pin the layer's experts in the cache;
  2. for each expert with tokens, by its home tier and the dispatcher:
       resident / cache hit  -> compute on the fast tier;
       disk                  -> read (pread, reader threads) into a cache slot or staging buffer;
       COPY                  -> H2D copy on the copy stream into a cache slot, compute on the
                                compute stream;
       CPU                   -> compute on the CPU worker with the host copy (activations move);
  3. combine the weighted outputs in expert order (as transformers does: identical sums).
With `read_ahead`, every missing expert's read is issued at once (reader threads + WILLNEED) and
each expert computes as soon as its weights land; without it, read -> compute -> read ... in turn.
Staging buffers are reused through dependencies: a read into a buffer waits for the compute that
last used it.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future

import torch

from tiered.memory.expert_cache import ExpertCache
from tiered.memory.expert_store import ExpertStore
from tiered.memory.placement import DISK
from tiered.models.moe import expert_forward
from tiered.runtime.dispatcher import COPY, CPU, RESIDENT, LatencyModel, choose_path
from tiered.runtime.executor import Executor


class StagingPool:
    """A ring of expert-sized buffers; each use depends on the previous user's completion future."""

    def __init__(self, buffers: list[tuple[torch.Tensor, ...]]) -> None:
        self.buffers = buffers
        self.busy: list[Future | None] = [None] * len(buffers)
        self.next = 0

    def take(self) -> tuple[tuple[torch.Tensor, ...], Future | None, int]:
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        return self.buffers[i], self.busy[i], i

    def release_after(self, i: int, fut: Future) -> None:
        self.busy[i] = fut


class TieredExperts:
    """Expert runner over tiers (an ExpertRunner, see models/moe.py).

    Args:
        store: home copies of experts (fast / CPU / disk).
        cache: fast-tier expert cache (may have 0 slots).
        executor: streams for disk reads, H2D copies, CPU and accelerator compute.
        latency: dispatcher latency model (only used with an accelerator).
        accelerator: Accelerator or None (the fast tier is then CPU RAM and compute is on the CPU).
        fast_staging, host_staging: staging buffer rings on the fast tier / in host memory.
        read_ahead: issue all of a layer's expert reads at once.
        force_path: tests only: force COPY or CPU for every non-resident expert.
    Attributes:
        path_counts: Counter of (path) over all dispatched experts; bytes_read: disk bytes read;
        resident_hits: uses of fast-resident experts (the cache's own stats count only its slots).
    """

    def __init__(self, store: ExpertStore, cache: ExpertCache, executor: Executor, latency: LatencyModel | None,
                 accelerator, fast_staging: StagingPool, host_staging: StagingPool | None,
                 read_ahead: bool = True, force_path: str | None = None) -> None:
        self.store, self.cache, self.executor, self.latency = store, cache, executor, latency
        self.accelerator = accelerator
        self.fast_staging, self.host_staging = fast_staging, host_staging
        self.read_ahead, self.force_path = read_ahead, force_path
        self.path_counts: Counter = Counter()
        self.bytes_read = 0
        self.bytes_h2d = 0
        self.resident_hits = 0
        self._pinned: set = set()
        self.num_experts = store.num_experts

    def __call__(self, layer_idx: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 block) -> torch.Tensor:
        counts = torch.bincount(topk_idx.flatten(), minlength=self.num_experts)
        experts = counts.nonzero().flatten().tolist()
        keys = [(layer_idx, e) for e in experts]
        self._pinned = set(keys)
        t_layer = time.perf_counter()
        acc = self.accelerator
        if acc is not None:
            acc.synchronize()
        # the CPU path's inputs, on the host once per layer: activations and the routing indices
        x_host = x if acc is None else acc.to_host(x)
        idx_host = topk_idx if acc is None else acc.to_host(topk_idx)
        if self.read_ahead:
            for key in keys:
                if self.store.tier(key) == DISK and key not in self.cache and key not in self.store.resident:
                    self.store.advise(key)
        results: dict[int, Future] = {}
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for e, key in zip(experts, keys):
            tok, kk = (topk_idx == e).nonzero(as_tuple=True)
            rows[e] = (tok, kk)
            fut = self._run_expert(key, int(counts[e]), x, x_host, tok, idx_host)
            if not self.read_ahead:
                fut.result()
            results[e] = fut
        out = torch.zeros_like(x)
        for e in experts:  # expert order, like transformers' index_add loop
            tok, kk = rows[e]
            y = results[e].result()
            if y.device != x.device:  # computed on the CPU behind an accelerator: back to the device
                y = acc.to_device(y)
            out.index_add_(0, tok, y * topk_weight[tok, kk, None].to(y.dtype))
        self.executor.record(f"moe layer {layer_idx}", "main", t_layer, time.perf_counter(), layer=layer_idx)
        return out

    def _weights_on_fast(self, key):
        w = self.store.resident.get(key)
        if w is not None:
            self.resident_hits += 1
            return w
        return self.cache.lookup(key)

    @property
    def fast_hit_rate(self) -> float:
        """Share of expert uses served from the fast tier: resident experts plus cache hits."""
        st = self.cache.stats
        n = self.resident_hits + st.hits + st.misses
        return (self.resident_hits + st.hits) / n if n else 0.0

    def _run_expert(self, key, tokens: int, x: torch.Tensor, x_host: torch.Tensor, tok: torch.Tensor,
                    idx_host: torch.Tensor) -> Future:
        """Dispatch expert `key` for rows `tok` of `x` (device); the CPU path reads `x_host` at the
        same rows, found in `idx_host` (topk_idx on the host) so no device index meets host data."""
        ex, layer, e = self.executor, key[0], key[1]
        w = self._weights_on_fast(key)
        compute_stream = "compute" if self.accelerator is not None else "cpu"
        if w is not None:
            self.path_counts[RESIDENT] += 1
            return ex.submit(compute_stream, lambda: expert_forward(x[tok], *w), name=f"expert L{layer}E{e}",
                             layer=layer, expert=e)
        on_disk = self.store.tier(key) == DISK
        if self.accelerator is None:  # fast tier is RAM: read from disk into a slot, compute on the CPU
            self.path_counts["disk"] += 1
            slot, dep, idx = self._slot_or_staging(key, self.fast_staging)
            read = ex.submit("disk", lambda: self.store.read(key, slot), deps=[dep] if dep else [],
                             name=f"read L{layer}E{e}", nbytes=self.store.expert_bytes, layer=layer, expert=e)
            self.bytes_read += self.store.expert_bytes
            fut = ex.submit("cpu", lambda: expert_forward(x[tok], *slot), deps=[read], name=f"expert L{layer}E{e}",
                            layer=layer, expert=e)
            if idx is not None:
                self.fast_staging.release_after(idx, fut)
            return fut
        path = self.force_path or choose_path(tokens, False, self.store.expert_bytes, self.latency)
        self.path_counts[path] += 1
        deps, host_w, host_idx = [], self.store.host.get(key), None
        if on_disk:
            host_w, dep, host_idx = self.host_staging.take()
            read = ex.submit("disk", lambda: self.store.read(key, host_w), deps=[dep] if dep else [],
                             name=f"read L{layer}E{e}", nbytes=self.store.expert_bytes, layer=layer, expert=e)
            self.bytes_read += self.store.expert_bytes
            deps = [read]
        if path == CPU:
            tok_host = (idx_host == e).nonzero(as_tuple=True)[0]
            fut = ex.submit("cpu", lambda: expert_forward(x_host[tok_host], *host_w), deps=deps,
                            name=f"cpu expert L{layer}E{e}", layer=layer, expert=e)
        else:
            slot, dep, idx = self._slot_or_staging(key, self.fast_staging)
            copy = ex.submit("copy", lambda: [self.accelerator.copy_to_device(d, s) for d, s in zip(slot, host_w)],
                             deps=deps + ([dep] if dep else []), name=f"h2d L{layer}E{e}",
                             nbytes=self.store.expert_bytes, layer=layer, expert=e)
            self.bytes_h2d += self.store.expert_bytes
            fut = ex.submit("compute", lambda: expert_forward(x[tok], *slot), deps=[copy],
                            name=f"expert L{layer}E{e}", layer=layer, expert=e)
            if idx is not None:
                self.fast_staging.release_after(idx, fut)
        if host_idx is not None:
            self.host_staging.release_after(host_idx, fut)
        return fut

    def _slot_or_staging(self, key, staging: StagingPool):
        """A cache slot for `key`, or a staging buffer (with the future it must wait for) when none is free."""
        slot = self.cache.claim(key, pinned=self._pinned)
        if slot is not None:
            return slot, None, None
        return staging.take()
