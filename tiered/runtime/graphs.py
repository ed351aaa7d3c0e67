"""CUDA-graph captured decode steps for a model that lives wholly on the GPU (gpt-fast's recipe).

A decode step of a small batch is a few hundred short kernels; launching them one by one from
Python costs more than the kernels themselves when the weights are on the GPU. `DecodeGraphs`
captures the step once per (batch size, KV-length bucket, cache) with static input buffers and
static-shape attention metadata (models/layers.build_static_decode_metadata: attention over the
bucket's positions with a device mask, no host sync), then replays it: one launch per token.

A capture is checked once against the eager step; if it fails or differs, graphs are switched off
for this engine and decode runs eagerly (`disabled` says why). Buckets are powers of two from 256
positions up to the cache's length, so attention reads at most twice the positions it needs.
Only models without an expert runner or sliced FFNs qualify: those synchronize with the host
inside the step (the Plan's `decode_graphs`).
"""

from __future__ import annotations

import torch

from tiered.models.layers import KVCache, build_static_decode_metadata

MIN_BUCKET = 256


def kv_bucket(kv_len: int, max_len: int) -> int:
    """The smallest power of two >= kv_len (at least MIN_BUCKET), capped at max_len [positions]."""
    b = MIN_BUCKET
    while b < kv_len:
        b *= 2
    return min(b, max_len)


class DecodeGraphs:
    """Replays captured decode steps of `model` on CUDA.

    Args:
        model: the CausalLM, every weight on the GPU.
        sliding_window: the model's attention window (None = full).
    Attributes:
        disabled: None, or why graphs were switched off (then `__call__` returns None).
        captures: number of graphs captured so far.
    """

    def __init__(self, model, sliding_window: int | None) -> None:
        self.model, self.window = model, sliding_window
        self._graphs: dict = {}
        self.disabled: str | None = None
        self.captures = 0

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVCache,
                 kv_len: int, contiguous: bool) -> torch.Tensor | None:
        """Logits [B, V] of one decode step (ids, positions int64 [B, 1], slots int64 [B], on the GPU),
        or None when graphs are off (the caller then runs the step eagerly)."""
        if self.disabled is not None:
            return None
        bucket = kv_bucket(kv_len, cache.max_len)
        key = (ids.shape[0], bucket, contiguous, id(cache))
        entry = self._graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(ids, positions, slots, cache, bucket, contiguous)
            except Exception as e:  # noqa: BLE001 - a capture failure falls back to eager decode
                self.disabled = f"capture failed: {type(e).__name__}: {e}"
                return None
            if entry is None:
                return None
            self._graphs[key] = entry
        graph, (s_ids, s_pos, s_slots), out = entry
        s_ids.copy_(ids)
        s_pos.copy_(positions)
        s_slots.copy_(slots)
        graph.replay()
        return out

    def _step(self, ids, positions, slots, cache, bucket, contiguous):
        meta = build_static_decode_metadata(self.model.rotary, positions, slots, bucket, self.window, contiguous)
        return self.model(ids, positions, slots, cache, meta=meta)

    def _capture(self, ids, positions, slots, cache, bucket, contiguous):
        static = (ids.clone(), positions.clone(), slots.clone())
        # the eager step writes this step's K/V too: run it last so the cache ends as eager decode leaves it
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up on a side stream, as torch.cuda.graph requires
                self._step(*static, cache, bucket, contiguous)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(*static, cache, bucket, contiguous)
        graph.replay()
        eager = self.model(ids, positions, slots, cache).float()
        # the static step attends over the whole bucket (masked) instead of exactly the cached
        # positions: other kernels, so 16-bit logits differ in their last bits
        tol = 1e-3 if out.dtype == torch.float32 else 3e-2
        err = float((out.float() - eager).abs().max() / eager.abs().max().clamp_min(1e-6))
        if err > tol:
            self.disabled = f"a captured step differed from the eager step (max relative error {err:.1e})"
            return None
        self.captures += 1
        return graph, static, out
