"""Expert prefetch: HOBBIT's Adaptive Expert Predictor (HOBBIT §3.2; ALGORITHMS.md 3.a-3.c).

At MoE layer l, the layer's gate input x [N, D] is fed to the routers of the next p MoE layers,
stacked into one weight [p*E, D] so the prediction is one matmul (`StackedGates`). The predicted
experts of those layers are masked against eviction; walking forward from l+1, the first layer
whose predictions are not all on the fast tier gets its missing experts loaded now (`Prefetcher`):
  - without an accelerator, read from disk into a RAM cache slot on the executor's disk readers;
  - with one, copied from pinned host RAM into a device cache slot on the copy stream.
At most `max_inflight` prefetches run at once (by default one reader fewer than the executor has),
so an on-demand read always finds a free reader; queued demand copies wait behind at most that many.

With mixed precision (HOBBIT §3.1-3.2: "prefetches use mixed precision"), each predicted expert gets
the precision the predicted router weights ask of it (runtime/precision.py, Eq. 2 and T1/T2): a
high need is loaded into the high pool, a low need into the low pool unless either pool holds the
expert, a skip is not loaded (only masked).

Gap H10: the next layers' gates see this layer's gate input, normalised with this layer's
RMSNorm weight; `fold_norms` rescales each stacked router by w_{l+r} / w_l (zero cost at predict
time) so it sees x as layer l+r's norm would have scaled it.

Prediction accuracy is reported per look-ahead distance r as recall: of the experts layer l+r
used, the share that the prediction made r MoE layers earlier named.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
import torch.nn.functional as F

from tiered.planner.placement import CPU, DISK


class StackedGates:
    """The routers of the next `lookahead` MoE layers of every MoE layer, stacked.

    Args:
        model: a CausalLM of an MoE architecture (its MoEBlocks and post-attention norms).
        lookahead: p >= 1, MoE layers predicted ahead.
        fold_norms: fold w_{l+r} / w_l of the post-attention RMSNorms into the stacked routers (H10).
    Attributes:
        stacks: layer -> (weight [r*E, D] fp32 on the routers' device, target layers [r]), r <= p.
        biases: layer -> the stacked routers' biases [r*E] fp32 (zeros for a router without one), where
            any of them has one (gpt-oss).
    """

    def __init__(self, model, lookahead: int, fold_norms: bool = True) -> None:
        from tiered.models.moe import moe_blocks

        blocks = moe_blocks(model)
        self.lookahead, self.num_experts = lookahead, blocks[0].gate.out_features if blocks else 0
        # each target layer's routing rule (Router.select: softmax top-k, or DeepSeek's groups, bias, scaling)
        self.routers = {b.layer_idx: b.gate for b in blocks}
        layers = model.model.layers
        self.stacks: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self.biases: dict[int, torch.Tensor] = {}  # layer -> the stacked routers' biases [r*E] fp32, where any has one
        for j, b in enumerate(blocks):
            nxt = blocks[j + 1:j + 1 + lookahead]
            if not nxt:
                continue
            w_l = layers[b.layer_idx].post_attention_layernorm.weight.detach().float()
            rows, biases = [], []
            for nb in nxt:
                w = nb.gate.weight.detach().float()
                if fold_norms:
                    w_t = layers[nb.layer_idx].post_attention_layernorm.weight.detach().float()
                    scale = torch.where(w_l.abs() > 1e-6, w_t / w_l, torch.ones_like(w_l))
                    w = w * scale
                rows.append(w)
                biases.append(getattr(nb.gate, "bias", None))  # gpt-oss's router: x W^T + b
            self.stacks[b.layer_idx] = (torch.cat(rows), [nb.layer_idx for nb in nxt])
            if any(v is not None for v in biases):  # (a router without one adds zeros: an op, no device factory)
                self.biases[b.layer_idx] = torch.cat([w[:, 0] * 0 if v is None else v.detach().float()
                                                      for w, v in zip(rows, biases)])

    def predict(self, layer: int, x: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """Predicted routing of the next MoE layers from layer `layer`'s gate input x [N, D].

        Returns:
            [(target layer, topk_idx int64 [N, k], topk_weight fp32 [N, k])] for r = 1..(at most p),
            in layer order; empty after the last MoE layer. One matmul for all r.
        """
        if layer not in self.stacks:
            return []
        w, targets = self.stacks[layer]
        E = self.num_experts
        logits = F.linear(x.float(), w, self.biases.get(layer)).view(x.shape[0], len(targets), E)  # (N, r, E)
        return [(t, *self.routers[t].select(logits[:, r])) for r, t in enumerate(targets)]


class Prefetcher:
    """Loads the predicted experts of the next MoE layers early and reports how well it predicts.

    Called once per MoE layer by the expert runner (`on_layer`), after it routed and before it looks
    its experts up. Keeps cache.protected = predicted experts of layers still ahead + loads in flight.

    Args:
        gates: the StackedGates of the model.
        cache: the fast-tier ExpertCache the loads fill.
        store: the ExpertStore (home tiers, disk reads, host copies).
        executor: streams "disk" (reads) and "copy" (H2D copies).
        accelerator: Accelerator or None (then the fast tier is RAM and only disk experts are prefetched).
        max_inflight: most prefetches running at once (>= 1).
        low: (mixed precision) the runner's low side (its store, cache and MixedPrecision `mixed`);
            None: every prefetch loads the high copy.
    Attributes:
        hits, total: per distance r (1-based): predicted-and-used experts, used experts.
        issued, useful, bytes: prefetch loads started, those whose expert was then used by the
        layer they were predicted for, bytes they moved.
    """

    def __init__(self, gates: StackedGates, cache, store, executor, accelerator=None, max_inflight: int = 1,
                 low=None) -> None:
        self.gates, self.cache, self.store, self.executor, self.accelerator = gates, cache, store, executor, accelerator
        self.low = low
        self.max_inflight = max(1, max_inflight)
        self.hits = [0] * gates.lookahead
        self.total = [0] * gates.lookahead
        self.issued = self.useful = self.bytes = 0
        self.masked: set = set()
        self.pending: dict[int, dict[int, set[int]]] = {}  # target layer -> {distance: predicted experts}
        self.inflight: dict = {}  # (key, low?) -> Future of its load
        self.loaded: set = set()  # keys loaded by a prefetch and not used yet

    def accuracy(self) -> dict[int, float]:
        """Recall per look-ahead distance r: share of the used experts that were predicted r layers before."""
        return {r + 1: self.hits[r] / self.total[r] for r in range(len(self.total)) if self.total[r]}

    def stats(self) -> dict:
        return {"issued": self.issued, "useful": self.useful, "bytes": self.bytes, "accuracy": self.accuracy()}

    def new_sequence(self) -> None:
        """Finish every load in flight and drop predictions and masks."""
        self._settle(wait=True)
        self.masked.clear()
        self.pending.clear()
        self.loaded.clear()
        self._protect(set())

    def on_layer(self, layer: int, x: torch.Tensor, used: list[int], pinned: set) -> None:
        """MoE layer `layer` runs experts `used` on gate input x [N, D]; `pinned`: its cache keys.

        Scores the earlier predictions for this layer, releases this layer's masks, predicts the next
        layers and issues the first layer's misses. It never waits: an expert of this layer whose
        prefetch is still landing is a hit whose compute depends on the load (`loading`).
        """
        for r, pred in self.pending.pop(layer, {}).items():
            self.hits[r - 1] += len(pred.intersection(used))
            self.total[r - 1] += len(used)
        for e in used:  # a load still in flight stays protected; the runner's compute waits for it (`loading`)
            key = (layer, e)
            if key in self.loaded:
                self.loaded.discard(key)
                self.useful += 1
        self.loaded = {k for k in self.loaded if k[0] != layer}  # predicted for this layer, unused
        self._settle(wait=False)
        self.masked = {k for k in self.masked if k[0] > layer}
        preds = self.gates.predict(layer, x)
        issue: list = []
        for r, (target, idx, w) in enumerate(preds, 1):
            experts = set(idx.flatten().tolist())
            self.pending.setdefault(target, {})[r] = experts
            if issue:
                continue  # later layers are predicted (and scored), not masked: the walk stopped
            self.masked.update((target, e) for e in experts)
            issue = [(key, low) for key, low in self._loads(target, idx, w) if self._missing(key, low)]
        self._protect(self.masked | {k for k, _ in self.inflight})
        for key, low in issue:
            if len(self.inflight) >= self.max_inflight:
                break
            self._load(key, low, pinned)
        self._protect(self.masked | {k for k, _ in self.inflight})

    def loading(self, key, low: bool = False) -> list[Future]:
        """[the Future of `key`'s prefetch at that precision] while it is in flight, else []: what
        computing `key` from that precision's pool must wait for."""
        fut = self.inflight.get((key, low))
        return [fut] if fut is not None and not fut.done() else []

    def _loads(self, target: int, idx: torch.Tensor, w: torch.Tensor) -> list[tuple[tuple[int, int], bool]]:
        """(key, low?) of each predicted expert of layer `target` that a prefetch would load: every
        one at high precision, or, with mixed precision, at the precision its predicted router
        weights ask for (skipped experts are left out)."""
        if self.low is None:
            return [((target, e), False) for e in sorted(set(idx.flatten().tolist()))]
        from tiered.runtime.precision import HIGH, SKIP

        needs = self.low.mixed.expert_needs(idx, w, self.gates.num_experts).tolist()
        return [((target, e), need != HIGH) for e, need in enumerate(needs) if need != SKIP]

    def _missing(self, key, low: bool) -> bool:
        """Not on the fast tier at the precision needed (a high copy also serves a low need), not
        loading, and loadable: a disk expert without an accelerator, a CPU-RAM expert with one (a disk
        expert behind an accelerator is left to the demand path)."""
        if key in self.store.resident or key in self.cache or (key, False) in self.inflight:
            return False
        store = self.store
        if low:
            if key not in self.low.store.handles:
                return False  # no low copy (a resident expert of the high side): nothing to prefetch low
            if key in self.low.cache or (key, True) in self.inflight:
                return False
            store = self.low.store
        return store.tier(key) == (DISK if self.accelerator is None else CPU)

    def _protect(self, keys: set) -> None:
        self.cache.protected = keys
        if self.low is not None:
            self.low.cache.protected = keys

    def _load(self, key, low: bool, pinned: set) -> None:
        side = self.low if low else self
        cache, store = side.cache, side.store
        slot = cache.claim(key, pinned | cache.protected, use=False)
        if slot is None:
            return
        layer, e, nbytes = key[0], key[1], store.expert_bytes
        tag = "low " if low else ""
        if self.accelerator is None:
            fut = self.executor.submit("disk", lambda: store.read(key, slot), name=f"prefetch {tag}read L{layer}E{e}",
                                       nbytes=nbytes, layer=layer, expert=e)
        else:  # waits on the device for work already issued: an evicted slot may still be read
            host, ready = store.host[key], self.accelerator.record_event()
            fut = self.executor.submit("copy", lambda: [self.accelerator.copy_to_device(d, s) for d, s in zip(slot, host)],
                                       name=f"prefetch {tag}h2d L{layer}E{e}", nbytes=nbytes, layer=layer, expert=e,
                                       after_event=ready)
        self.inflight[(key, low)] = fut
        self.loaded.add(key)
        self.issued += 1
        self.bytes += nbytes

    def _settle(self, wait: bool) -> None:
        """Forget finished loads (raising their errors); with `wait`, finish all of them first."""
        for key, fut in list(self.inflight.items()):
            if wait or fut.done():
                fut.result()
                del self.inflight[key]
