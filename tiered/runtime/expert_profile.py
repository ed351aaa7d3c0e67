"""Expert-popularity profiling: tokens routed and gate mass per (layer, expert) over a prompt set.

The profile drives Fiddler's popularity placement (§3.4; ALGORITHMS.md 2.b): the experts with
the most routed tokens are placed on the fast tier. It hooks `MoEBlock.on_route`; nothing in the
model changes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


class ExpertProfiler:
    """Counts routing decisions. tokens, gate_mass: float64 [L, E] (dense layers stay 0)."""

    def __init__(self, num_layers: int, num_experts: int, keep_trace: bool = False) -> None:
        self.tokens = np.zeros((num_layers, num_experts))
        self.gate_mass = np.zeros((num_layers, num_experts))
        # with keep_trace: every routing decision in order, as (layer, tokens, sorted experts used)
        self.trace: list[tuple[int, int, tuple[int, ...]]] | None = [] if keep_trace else None

    @classmethod
    def attach(cls, model, config, keep_trace: bool = False) -> "ExpertProfiler":
        """A profiler hooked into every MoEBlock of `model`."""
        from tiered.models.moe import moe_blocks

        prof = cls(config.num_hidden_layers, config.num_experts, keep_trace)
        for block in moe_blocks(model):
            block.on_route = prof.record
        return prof

    def record(self, layer: int, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> None:
        """Add one routing decision: topk_idx int64 [N, k], topk_weight [N, k]."""
        E = self.tokens.shape[1]
        idx = topk_idx.flatten().cpu()
        counts = torch.bincount(idx, minlength=E).numpy()
        self.tokens[layer] += counts
        if self.trace is not None:
            self.trace.append((layer, int(topk_idx.shape[0]), tuple(int(e) for e in counts.nonzero()[0])))
        self.gate_mass[layer] += torch.zeros(E, dtype=torch.float64).index_add_(
            0, idx, topk_weight.flatten().double().cpu()).numpy()

    def save(self, path: str | Path, **meta) -> None:
        """Write {"tokens": [[..]], "gate_mass": [[..]], "layers", "experts", ...meta} as JSON."""
        L, E = self.tokens.shape
        Path(path).write_text(json.dumps({"layers": L, "experts": E, "tokens": self.tokens.tolist(),
                                          "gate_mass": self.gate_mass.tolist(), **meta}))


def draw_heatmap(tokens: np.ndarray, path: str | Path, title: str = "tokens routed per expert") -> None:
    """Heat map of routed tokens, normalized per layer, layers as rows (like Fiddler's Fig. 8)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = tokens / np.maximum(tokens.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(max(4, tokens.shape[1] * 0.35 + 2), max(3, tokens.shape[0] * 0.3 + 1.5)))
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="share of the layer's routed tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
