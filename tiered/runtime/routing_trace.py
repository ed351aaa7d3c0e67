"""Routing traces: which experts every token used at every MoE layer, with their gate scores and
what the stacked next-layer gates predicted (HOBBIT §3.2-3.3; ALGORITHMS.md gap H7: traces drive
a cache simulator). `tiered profile-experts --trace FILE` writes one; `tiered cache-sim` replays it.

File format (NumPy .npz, read with allow_pickle=False), R rows, one per (routing call, token):
    seq        int32 [R]        sequence number (0, 1, ...; each prompt is one sequence)
    pos        int32 [R]        the token's index in its sequence (prompt tokens first)
    step       int32 [R]        forward pass number over the whole trace (a prefill is one step)
    layer      int32 [R]        decoder layer index of the MoE layer
    experts    int32 [R, k]     routed experts, in the router's top-k order (largest gate first)
    weights    float32 [R, k]   their gate weights as the block uses them (normalised over the
                                top-k when the model's router does so)
    predicted  int32 [R, p, k]  top-k the stacked gates of this layer predicted for the r-th next
                                MoE layer (r = 1..p), -1 where there is no such layer
    meta       0-d str          JSON: format "tiered-routing-trace", version 1, model, model_type,
                                num_layers, num_experts, top_k, moe_layers, lookahead,
                                norm_topk_prob, expert_bytes {"fp32", "bf16", "int8", "int4": bytes}
Rows are in execution order: the rows of one step and layer are consecutive.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from tiered.errors import ConfigError

FORMAT, VERSION = "tiered-routing-trace", 1
_ARRAYS = ("seq", "pos", "step", "layer", "experts", "weights", "predicted")


class RoutingRecorder:
    """Records a routing trace from a model's MoEBlocks (forward pre-hook for the gate input, and
    `on_route`, chained after any hook already there).

    Args:
        model: the CausalLM (its MoEBlocks are hooked).
        config: its ModelConfig.
        lookahead: p, MoE layers predicted ahead by runtime/prefetch.StackedGates (0 = none).
    """

    def __init__(self, model, config, lookahead: int = 2) -> None:
        from tiered.memory import sizes
        from tiered.models.moe import moe_blocks
        from tiered.runtime.prefetch import StackedGates

        blocks = moe_blocks(model)
        self.gates = StackedGates(model, lookahead) if lookahead else None
        self.lookahead, self.top_k = lookahead, config.num_experts_per_tok
        self.meta = {"format": FORMAT, "version": VERSION, "model_type": config.model_type,
                     "num_layers": config.num_hidden_layers, "num_experts": config.num_experts,
                     "top_k": config.num_experts_per_tok, "moe_layers": [b.layer_idx for b in blocks],
                     "lookahead": lookahead, "norm_topk_prob": bool(config.norm_topk_prob),
                     "expert_bytes": {f: sizes.expert_bytes(config, f) for f in ("fp32", "bf16", "int8", "int4")}}
        self.rows: dict[str, list] = {k: [] for k in _ARRAYS}
        self.seq, self.tokens, self.step = -1, 0, -1
        self._last_layer: int | None = None
        self._x: torch.Tensor | None = None
        for b in blocks:
            b.register_forward_pre_hook(self._capture)
            prev = b.on_route
            b.on_route = self.record if prev is None else (lambda l, i, w, prev=prev: (prev(l, i, w), self.record(l, i, w)))
        self.new_sequence()

    def _capture(self, _block, args) -> None:
        x = args[0]
        self._x = x.reshape(-1, x.shape[-1])

    def new_sequence(self) -> None:
        """The next rows belong to a new sequence (its token positions start at 0)."""
        self.seq += 1
        self.tokens = 0
        self._last_layer = None

    def record(self, layer: int, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> None:
        """One routing call: topk_idx int64 [N, k], topk_weight [N, k] (on any device)."""
        n = topk_idx.shape[0]
        if self._last_layer is None or layer <= self._last_layer:  # a new forward step
            self.tokens += n
            self.step += 1
        self._last_layer = layer
        pred = np.full((n, max(self.lookahead, 1), self.top_k), -1, dtype=np.int32)
        if self.gates is not None and self._x is not None:
            for r, (_t, idx, _w) in enumerate(self.gates.predict(layer, self._x)):
                pred[:, r] = idx.cpu().numpy()
        r = self.rows
        r["seq"].append(np.full(n, self.seq, np.int32))
        r["pos"].append(np.arange(self.tokens - n, self.tokens, dtype=np.int32))
        r["step"].append(np.full(n, self.step, np.int32))
        r["layer"].append(np.full(n, layer, np.int32))
        r["experts"].append(topk_idx.cpu().numpy().astype(np.int32))
        r["weights"].append(topk_weight.float().cpu().numpy())
        r["predicted"].append(pred[:, :self.lookahead] if self.lookahead else pred[:, :0])

    def trace(self, **meta) -> "RoutingTrace":
        """What was recorded, as a RoutingTrace (`meta` entries added to its metadata)."""
        arrays = {k: (np.concatenate(v) if v else np.zeros((0,), np.int32)) for k, v in self.rows.items()}
        return RoutingTrace(**arrays, meta={**self.meta, **meta})


@dataclass
class RoutingTrace:
    """A loaded routing trace (see the module docstring for the arrays)."""

    seq: np.ndarray
    pos: np.ndarray
    step: np.ndarray
    layer: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    predicted: np.ndarray
    meta: dict

    def save(self, path: str | Path) -> None:
        """Write the .npz file (compressed)."""
        with open(path, "wb") as f:  # np.savez would append .npz to a name without it
            np.savez_compressed(f, **{k: getattr(self, k) for k in _ARRAYS}, meta=np.array(json.dumps(self.meta)))

    @classmethod
    def load(cls, path: str | Path) -> "RoutingTrace":
        """Read a trace. Raises ConfigError when the file is missing or not a routing trace."""
        hint = "record one with `tiered profile-experts PROMPTS --trace FILE`"
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
                arrays = {k: z[k] for k in _ARRAYS}
        except FileNotFoundError:
            raise ConfigError(f"no routing trace at {path}", hint) from None
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{path} is not a routing trace ({e})", hint) from None
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ConfigError(f"{path} is not a version-{VERSION} routing trace", hint)
        return cls(**arrays, meta=meta)

    def __len__(self) -> int:
        return len(self.layer)

    def select(self, seqs) -> "RoutingTrace":
        """The trace of the sequences numbered in `seqs` only (e.g. a calibration / held-out split)."""
        keep = np.isin(self.seq, list(seqs))
        return RoutingTrace(**{k: getattr(self, k)[keep] for k in _ARRAYS}, meta=dict(self.meta))

    def groups(self) -> Iterator[tuple[int, int, int, slice]]:
        """(seq, step, layer, rows) of every routing call, in execution order."""
        if not len(self):
            return
        key = self.step.astype(np.int64) * (self.meta["num_layers"] + 1) + self.layer
        cuts = np.flatnonzero(np.diff(key)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [len(key)]])
        for a, b in zip(starts.tolist(), ends.tolist()):
            yield int(self.seq[a]), int(self.step[a]), int(self.layer[a]), slice(a, b)


def prediction_accuracy(trace: RoutingTrace) -> dict[int, float]:
    """Recall per look-ahead distance r (as runtime/prefetch.Prefetcher counts it): over every
    routing call of a MoE layer, the share of the experts it used that the prediction made r MoE
    layers earlier in the same step named."""
    moe = trace.meta["moe_layers"]
    nxt = {l: moe[i + 1:] for i, l in enumerate(moe)}
    used: dict[tuple[int, int], set] = {}
    for _, step, layer, rows in trace.groups():
        used[(step, layer)] = set(trace.experts[rows].ravel().tolist())
    hits = [0] * trace.predicted.shape[1] if trace.predicted.ndim == 3 else []
    total = [0] * len(hits)
    for _, step, layer, rows in trace.groups():
        for r in range(len(hits)):
            if r >= len(nxt[layer]):
                break
            actual = used.get((step, nxt[layer][r]))
            if actual is None:
                continue
            pred = set(trace.predicted[rows, r].ravel().tolist()) - {-1}
            hits[r] += len(pred & actual)
            total[r] += len(actual)
    return {r + 1: hits[r] / total[r] for r in range(len(hits)) if total[r]}
