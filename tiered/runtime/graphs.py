"""Decode steps captured as CUDA graphs (gpt-fast's recipe), whole or piecewise (vLLM's).

A decode step of a small batch is a few hundred short kernels; launching them one by one from
Python costs more than the kernels themselves when the weights are on the GPU (on the H200's host,
2026-11-26: ~1.8 ms of host ops per layer of the sliced dense step, ~24 us per op). Graphs capture
the step once per (batch size, KV-length bucket, cache) with static input buffers and static-shape
attention metadata (models/layers.build_static_decode_metadata: attention over the bucket's
positions with a device mask, no host sync), then replay it.

- `DecodeGraphs` captures the whole step: one launch per token. For a model wholly on the GPU
  (Plan.decode_graphs).
- `PiecewiseGraphs` captures the step between the layers' MLPs: graph 0 is the metadata, the
  embedding and layer 0's attention (`DecoderLayer.attention_residual`) and post-attention norm;
  graph i adds layer i-1's MLP output to its residual and runs layer i's attention and norm; the
  last graph makes the logits. The MLPs run eagerly between replays, because they sync with the
  host: the expert runner (an MoE layer's routing read on the host, CPU experts) and the sliced
  FFNs (the CC slice on the CPU). For an offloading plan whose attention is on the GPU
  (Plan.piecewise_graphs): its host then issues one launch per layer instead of ~45 ops.

The graphs of one capture share a memory pool and replay in capture order. Capture goes through
`Accelerator.capture`: on the host stand-in the segments run eagerly at each replay with host
syncs refused, so CPU-only tests check what would break a capture. A capture is checked once
against the eager step; if it fails or differs, graphs are switched off for this engine and decode
runs eagerly (`disabled` says why). With piecewise graphs that check runs the step's MLPs twice
(the expert cache counts that step's uses twice), once per captured bucket. Buckets are powers of
two from 256 positions up to the cache's length, so attention reads at most twice the positions it
needs.
"""

from __future__ import annotations

import torch

from tiered.models.layers import KVCache, build_static_decode_metadata
from tiered.models.moe import moe_blocks

MIN_BUCKET = 256


def kv_bucket(kv_len: int, max_len: int) -> int:
    """The smallest power of two >= kv_len (at least MIN_BUCKET), capped at max_len [positions]."""
    b = MIN_BUCKET
    while b < kv_len:
        b *= 2
    return min(b, max_len)


class DecodeGraphs:
    """Replays captured decode steps of `model` (the whole step as one graph).

    Args:
        model: the CausalLM, every weight on the accelerator.
        accelerator: the Accelerator that captures (CUDA; the host stand-in checks capture rules).
        sliding_window: the model's attention window (None = full).
    Attributes:
        disabled: None, or why graphs were switched off (then `__call__` returns None).
        captures: number of steps captured so far (one per batch size, bucket and cache).
        steps: decode steps run through the graphs.
    """

    def __init__(self, model, accelerator, sliding_window: int | None) -> None:
        self.model, self.accelerator, self.window = model, accelerator, sliding_window
        self._blocks = moe_blocks(model)
        self._graphs: dict = {}
        self.disabled: str | None = None
        self.captures = 0
        self.steps = 0

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                 kv_len: int, contiguous: bool) -> torch.Tensor | None:
        """Logits [B, V] of one decode step (ids, positions int64 [B, 1], slots int64 [B], on the
        device), or None when graphs are off (the caller then runs the step eagerly)."""
        if self.disabled is not None or self._hooked():
            return None
        bucket = kv_bucket(kv_len, cache.max_len)
        key = (ids.shape[0], bucket, contiguous, id(cache))
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture_checked(ids, positions, slots, cache, bucket, contiguous)
            except Exception as e:  # noqa: BLE001 - a capture failure falls back to eager decode
                self.disabled = f"capture failed: {type(e).__name__}: {e}"
                self.accelerator.synchronize()  # a broken device (not just a refused capture) raises here
                return None
            if entry is None:
                return None
            self._graphs[key] = entry
        run, (s_ids, s_pos, s_slots), out = entry
        s_ids.copy_(ids)
        s_pos.copy_(positions)
        s_slots.copy_(slots)
        self.steps += 1
        return run()

    def _hooked(self) -> bool:
        """A routing hook (MoEBlock.on_route: an expert profile, a routing trace) is set: Python code a
        replay of the whole step would skip, so such steps run eagerly."""
        return any(b.on_route is not None for b in self._blocks)

    def _meta(self, positions, slots, bucket, contiguous):
        return build_static_decode_metadata(self.model.rotary, positions, slots, bucket, self.window, contiguous)

    def _capture(self, static, cache, bucket, contiguous):
        """(run, logits): run() replays the step from the static inputs and returns its logits."""
        ids, positions, slots = static
        replay, out = self.accelerator.capture(
            lambda: self.model(ids, positions, slots, cache, meta=self._meta(positions, slots, bucket, contiguous)))

        def run():
            replay()
            return out
        return run, out

    def _capture_checked(self, ids, positions, slots, cache, bucket, contiguous):
        static = (ids.clone(), positions.clone(), slots.clone())
        run, out = self._capture(static, cache, bucket, contiguous)
        # the captured step writes this step's K/V too: run the eager step last, so the cache ends
        # as eager decode leaves it
        run()
        eager = self.model(ids, positions, slots, cache).float()
        # the static step attends over the whole bucket (masked) instead of exactly the cached
        # positions: other kernels, so 16-bit logits differ in their last bits
        tol = 1e-3 if out.dtype == torch.float32 else 3e-2
        err = float((out.float() - eager).abs().max() / eager.abs().max().clamp_min(1e-6))
        if err > tol:
            self.disabled = f"a captured step differed from the eager step (max relative error {err:.1e})"
            return None
        self.captures += 1
        return run, static, out


class PiecewiseGraphs(DecodeGraphs):
    """Replays decode steps captured piecewise: one graph per layer's attention (with the residual
    add of the previous layer's MLP output), the layers' MLPs eager in between (see the module doc).

    Same arguments and attributes as DecodeGraphs. `model`'s attention, norms, embedding and head
    must be on the accelerator; its MLPs may be anything that takes and returns [B, 1, D] there.
    Routing hooks fire as in eager decode: the MoE blocks (router included) run eagerly.
    """

    def _hooked(self) -> bool:
        return False

    def _capture(self, static, cache, bucket, contiguous):
        ids, positions, slots = static
        model, acc = self.model, self.accelerator
        layers = model.model.layers
        pool = acc.graph_pool()
        shared: dict = {}  # graph 0's metadata, read by every later graph

        def first():
            shared["meta"] = meta = self._meta(positions, slots, bucket, contiguous)
            layer = layers[0]
            h = layer.attention_residual(model.embed(ids), meta, cache)
            return h, layer.ffn_norm(h)

        def middle(i, h_prev, y_prev):
            def segment():
                layer = layers[i]
                h = layer.attention_residual(h_prev + y_prev, shared["meta"], cache)
                return h, layer.ffn_norm(h)
            return segment

        def last(h_prev, y_prev):
            def segment():
                return model.head(model.model.norm(h_prev + y_prev)[:, -1:])[:, -1]
            return segment

        replays, outs, mlp_out = [], [], []
        replay, out = acc.capture(first, pool)
        replays.append(replay), outs.append(out)
        for i in range(1, len(layers) + 1):
            # a CUDA capture's outputs hold nothing until replayed: the next capture's warm-up runs
            # read real metadata and activations (and write K/V only at this step's positions)
            replays[-1]()
            y = torch.zeros_like(outs[-1][0])  # layer i-1's MLP output, written before each replay
            mlp_out.append(y)
            seg = middle(i, outs[-1][0], y) if i < len(layers) else last(outs[-1][0], y)
            replay, out = acc.capture(seg, pool)
            replays.append(replay), outs.append(out)

        def run():
            shared  # noqa: B018 - graph 0's metadata tensors live as long as the graphs that read them
            replays[0]()
            for i, layer in enumerate(layers):
                mlp_out[i].copy_(layer.ffn_output(layer.mlp(outs[i][1])))
                replays[i + 1]()
            return outs[-1]
        return run, outs[-1]
