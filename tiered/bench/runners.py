"""The engines a benchmark measures, behind one small interface, and the latency measurement.

A runner holds one loaded model and answers two questions, both greedy with EOS ignored:
    ttft_s(ids)                     seconds from handing over the prompt to holding the first token
    decode_tokens_per_s(ids, n)     (n - 1) / (t(n) - t(1)) over n generated tokens (timing.py)
and `close()` frees it. `TieredRunner` wraps tiered.LLM (its RequestStats use the same
definitions); `HFRunner` wraps a transformers model, whole on one device or dispatched by
accelerate (device_map="auto" with max_memory), driven by a bare forward loop with its KV cache
(the leanest transformers loop; generate() adds overhead).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Protocol, Sequence

import torch

from tiered.bench.timing import decode_tokens_per_s, median, repeat


class Runner(Protocol):
    def ttft_s(self, ids: Sequence[int]) -> float: ...
    def decode_tokens_per_s(self, ids: Sequence[int], new_tokens: int) -> float: ...
    def info(self) -> dict: ...
    def close(self) -> None: ...


class TieredRunner:
    """tiered.LLM(model, config); info() holds the plan's predictions and the expert runtime's counters."""

    def __init__(self, model: str | Path, config) -> None:
        from tiered import LLM, SamplingParams

        self._sp = SamplingParams
        t0 = time.perf_counter()
        self.llm = LLM(model, config)
        self.load_s = time.perf_counter() - t0

    def _generate(self, ids: Sequence[int], n: int):
        out = self.llm.generate([list(ids)], self._sp(temperature=0, max_tokens=n, ignore_eos=True))[0]
        if out.stats.generated_tokens != n:
            raise RuntimeError(f"asked for {n} tokens, got {out.stats.generated_tokens}")
        return out.stats

    def ttft_s(self, ids: Sequence[int]) -> float:
        return self._generate(ids, 1).ttft_s

    def decode_tokens_per_s(self, ids: Sequence[int], new_tokens: int) -> float:
        return self._generate(ids, new_tokens).decode_tokens_per_s  # (n - 1) / (t(n) - t(1))

    def info(self) -> dict:
        """load_s; the plan's predicted decode tok/s, TTFT [s] (None for a rules plan, `--plan off`,
        which predicts nothing) and summary; the decode graphs' kind, steps and captures (or why they
        were switched off) when the plan graphs; for MoE the runtime's hit rate, misses, expert paths
        and placement."""
        plan = self.llm.plan
        predicts = plan.source != "rules"
        out = {"load_s": self.load_s,
               "predicted_decode_tokens_per_s": plan.predicted_decode_tokens_per_s if predicts else None,
               "predicted_ttft_s": plan.predicted_ttft_s if predicts else None,
               "plan_prompt_tokens": plan.prompt_tokens if predicts else None,
               "plan": plan.summary()}
        g = self.llm.runtime.graphs
        if g is not None:  # which graphs decoded, how many steps, or why they were switched off
            out["graphs"] = {"kind": type(g).__name__, "steps": g.steps, "captures": g.captures, "disabled": g.disabled}
        rt = self.llm.runtime_stats()
        for key in ("hit_rate", "hits", "misses", "resident_hits", "paths", "placement", "peak_fast_bytes",
                    "bytes_h2d", "bytes_read"):
            if key in rt:
                out[key] = rt[key]
        return out

    def write_trace(self, path: str | Path) -> bool:
        """Write the run's timeline (needs EngineConfig(trace=True)); False when nothing was recorded."""
        if not self.llm.trace_events():
            return False
        self.llm.write_trace(path)
        return True

    def close(self) -> None:
        self.llm.close()
        del self.llm
        free_memory()


class HFRunner:
    """A transformers AutoModelForCausalLM.

    Args:
        model: Hugging Face model directory.
        dtype: weight and activation dtype.
        device: where the whole model goes when device_map is None ("cuda", "cpu").
        max_memory: accelerate budgets, e.g. {0: 4 * 2**30, "cpu": 100 * 2**30} [bytes]; given,
            the model is dispatched with device_map="auto" and what does not fit is offloaded
            (to the CPU, then to `offload_folder` on disk).
    """

    def __init__(self, model: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                 max_memory: dict | None = None, offload_folder: str | Path | None = None) -> None:
        from transformers import AutoModelForCausalLM

        kw: dict = {"dtype": dtype, "device_map": device}  # loaded straight onto the device
        if max_memory is not None:
            kw.update(device_map="auto", max_memory=max_memory)
            if offload_folder is not None:
                kw["offload_folder"] = str(offload_folder)
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(model), **kw).eval()
        if max_memory is None:
            self.device = torch.device(device)
        else:
            where = {f"cuda:{d}" if isinstance(d, int) else str(d) for d in self.model.hf_device_map.values()}
            gpu = sorted(d for d in where if d.startswith("cuda"))  # inputs go where the first layers are
            self.device = torch.device(gpu[0] if gpu else "cpu")
        self.load_s = time.perf_counter() - t0

    def _forward(self, ids: torch.Tensor, past=None):
        out = self.model(input_ids=ids.to(self.device), past_key_values=past, use_cache=True, logits_to_keep=1)
        return out.past_key_values, int(out.logits[0, -1].argmax())  # int() waits for the device

    def ttft_s(self, ids: Sequence[int]) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            self._forward(torch.tensor([list(ids)]))
            return time.perf_counter() - t0

    def decode_tokens_per_s(self, ids: Sequence[int], new_tokens: int) -> float:
        with torch.inference_mode():
            past, tok = self._forward(torch.tensor([list(ids)]))
            times = [time.perf_counter()]
            for _ in range(new_tokens - 1):
                past, tok = self._forward(torch.tensor([[tok]]), past)
                times.append(time.perf_counter())
        return decode_tokens_per_s(times)

    def info(self) -> dict:
        """load_s, and for a dispatched model how many modules accelerate put on each device."""
        out = {"load_s": self.load_s}
        dm = getattr(self.model, "hf_device_map", None)
        if dm:
            counts: dict[str, int] = {}
            for d in dm.values():
                counts[str(d)] = counts.get(str(d), 0) + 1
            out["device_map_modules"] = counts
        return out

    def close(self) -> None:
        del self.model
        free_memory()


def measure_latency(runner: Runner, ttft_prompt: Sequence[int], decode_prompt: Sequence[int], new_tokens: int,
                    repeats: int, warmup_prompt: Sequence[int] | None = None) -> dict:
    """Warm up (one prefill of a prompt as long as `ttft_prompt`, one short decode), then the
    median over `repeats` of TTFT [s] of `ttft_prompt` and of decode [tokens/s] for `new_tokens`
    tokens after `decode_prompt`. Returns ttft_s, decode_tokens_per_s and the runs."""
    runner.ttft_s(warmup_prompt if warmup_prompt is not None else ttft_prompt)
    runner.decode_tokens_per_s(decode_prompt, min(new_tokens, 4))
    ttft = repeat(lambda: runner.ttft_s(ttft_prompt), repeats)
    dec = repeat(lambda: runner.decode_tokens_per_s(decode_prompt, new_tokens), repeats)
    return {"ttft_s": median(ttft), "decode_tokens_per_s": median(dec), "ttft_runs_s": ttft,
            "decode_runs_tokens_per_s": dec}


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks, so the next engine starts from empty memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
