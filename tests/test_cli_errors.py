"""Bad input at the command line: one `error: ... — fix` line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from runtime_fixtures import rt  # noqa: F401  (fixture)
from tiered.cli import app


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def _bad(runner, args, expect):
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and " — " in lines[0], res.output
    assert expect in lines[0]
    assert "Traceback" not in res.output


def test_missing_path(runner):
    _bad(runner, ["run", "hi", "--model", "/nonexistent/model"], "does not exist")


def test_directory_without_config(runner, tmp_path):
    _bad(runner, ["run", "hi", "--model", str(tmp_path)], "no config.json")


def test_truncated_safetensors(runner, zoo, tmp_path):
    import shutil

    d = tmp_path / "model"
    shutil.copytree(zoo.dir("llama"), d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _bad(runner, ["run", "hi", "--model", str(d)], "truncated")


def test_truncated_gguf(runner, zoo, tmp_path):
    src = zoo.gguf("llama")
    f = tmp_path / "cut.gguf"
    f.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    _bad(runner, ["run", "hi", "--model", str(f)], "cut.gguf")


def test_unsupported_architecture(runner, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    _bad(runner, ["run", "hi", "--model", str(tmp_path)], "unsupported architecture")


def test_prompt_longer_than_context(runner, zoo):
    _bad(runner, ["run", "a b c d e f g h i j k l", "--model", str(zoo.dir("llama")), "--no-chat",
                  "--max-context", "4"], "context window is 4")


def test_budget_too_small(runner, zoo):
    _bad(runner, ["run", "hi", "--model", str(zoo.dir("llama")), "--cpu-mem", "1KiB", "--accelerator", "none"],
         "CPU budget 1.0 KiB cannot hold")


def test_an_unknown_kv_cache_dtype(runner, zoo):
    _bad(runner, ["run", "hi", "--model", str(zoo.dir("llama")), "--kv-cache-dtype", "q4"], "kv_cache_dtype")


def test_run_with_an_int8_kv_cache(runner, zoo):
    """`--kv-cache-dtype int8` reaches the plan (`--show-plan` names it) and the run completes."""
    res = runner.invoke(app, ["run", "hi", "--model", str(zoo.dir("llama")), "--no-chat", "-n", "4",
                              "--accelerator", "none", "--kv-cache-dtype", "int8", "--show-plan"])
    assert res.exit_code == 0, res.output
    assert "kv_cache int8" in res.output


# ------------------------------------------------------------ the first run on a fresh machine
@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    """No saved hardware profile yet, as on a machine's first run: the planner's quick measurement
    (and its note) happens; here it returns a made-up CPU profile and is counted."""
    import tiered.hardware.profiler as profiler
    from tiered.hardware.profile import HardwareProfile, LinearModel

    monkeypatch.setenv("TIERED_CACHE", str(tmp_path / "cache"))
    calls = []
    models = {"gemm/cpu/fp32": LinearModel(1e-5, 2e-11, 1.0), "gemv/cpu/fp32": LinearModel(0.0, 5e-11, 1.0),
              "attn/cpu/fp32": LinearModel(0.0, 1e-10, 1.0), "memory/bandwidth/cpu": LinearModel(0.0, 5e-11, 1.0),
              "memory/copy/cpu": LinearModel(0.0, 1e-10, 1.0), "disk/read_cold": LinearModel(1e-4, 5e-10, 1.0),
              "launch/cpu": LinearModel(1e-6, 0.0), "runtime/task": LinearModel(5e-5, 0.0)}

    def measure(**kw):
        calls.append(kw)
        return HardwareProfile("fresh", "test", models, None, 16 * 2**30)
    monkeypatch.setattr(profiler, "profile_machine", measure)
    return calls


def test_first_run_refuses_a_long_prompt_before_measuring(runner, zoo, fresh_machine):
    _bad(runner, ["run", "a b c d e f g h i j k l", "--model", str(zoo.dir("llama")), "--no-chat",
                  "--max-context", "4"], "context window is 4")
    assert fresh_machine == []  # refused before anything was loaded or measured


def test_first_run_error_after_measuring_is_still_one_line(runner, zoo, fresh_machine):
    """The budget is checked after the plan, so the machine is measured first; the note shown
    meanwhile does not stay above the error."""
    _bad(runner, ["run", "hi", "--model", str(zoo.dir("llama")), "--cpu-mem", "1KiB", "--accelerator", "none"],
         "CPU budget 1.0 KiB cannot hold")
    assert len(fresh_machine) == 1


def test_cli_and_engine_share_one_opened_checkpoint(zoo):
    """`run` opens the checkpoint to check the prompt, then hands it to LLM: one tokenizer load."""
    from tiered import LLM, EngineConfig
    from tiered.checkpoint import open_checkpoint

    ckpt = open_checkpoint(zoo.dir("llama"))
    assert open_checkpoint(ckpt) is ckpt
    tok = ckpt.tokenizer()
    assert tok is not None and ckpt.tokenizer() is tok
    llm = LLM(ckpt, EngineConfig(accelerator="none", plan="off", max_context=32))
    assert llm.checkpoint is ckpt and llm.tokenizer is tok


def test_only_the_console_process_freezes_the_heap(monkeypatch):
    """cli._freeze_heap (gc.freeze after a load) acts in the console entry point only: a program
    that runs the commands in its own process (this one) keeps its collector whole. Counted from what
    the process had frozen before (on the H100 machine, 2026-11-26, a pytest-xdist worker started with
    375 objects frozen by something other than tiered)."""
    import gc

    from tiered import cli

    before = gc.get_freeze_count()
    monkeypatch.setattr(cli, "_CONSOLE", False)
    cli._freeze_heap()
    assert gc.get_freeze_count() == before
    gc.collect()
    seen = []
    monkeypatch.setattr(cli, "app", lambda: (cli._freeze_heap(), seen.append(gc.get_freeze_count())))
    try:
        cli.main()
    finally:
        gc.unfreeze()
    assert seen and seen[0] > before


def test_tiered_run_takes_token_ids_for_a_checkpoint_without_a_tokenizer(rt):
    """`tiered run` on a generated checkpoint (no tokenizer): the prompt as space-separated token ids, the
    generated ids printed; text is refused with a one-line error saying so, before anything loads."""
    path = str(rt.dir("mixtral"))
    args = ["run", "--model", path, "--no-chat", "-n", "3", "-t", "0", "--max-context", "64"]
    res = CliRunner().invoke(app, [*args, "5 6 7"])
    assert res.exit_code == 0, res.output
    lines = [line.split() for line in res.output.splitlines()]
    assert any(len(ids) == 3 and all(i.isdigit() for i in ids) for ids in lines), res.output  # the 3 new ids
    bad = CliRunner().invoke(app, [*args, "hello there"])
    assert bad.exit_code != 0 and "space-separated token ids" in bad.output


@pytest.mark.parametrize("prompt, stdin, expect", [
    ("", None, "the prompt is empty"),
    ("-", "  \n", "read from stdin is empty"),
    ("-", b"caf\xe9 au lait", "not UTF-8"),
    ("caf\udce9", None, "not UTF-8"),  # how a non-UTF-8 argument reaches Python
])
def test_an_empty_or_undecodable_prompt_is_refused(runner, zoo, prompt, stdin, expect):
    res = runner.invoke(app, ["run", prompt, "--model", str(zoo.dir("llama")), "-n", "2"], input=stdin)
    assert res.exit_code == 2 and expect in res.output and "Traceback" not in res.output, res.output
    assert "haiku" not in res.output  # not replaced by the default prompt


def test_stdin_prompt_is_read_when_piped(runner, zoo):
    res = runner.invoke(app, ["run", "--model", str(zoo.dir("llama")), "-n", "2", "--json", "--no-chat"],
                        input="hello there\n")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["prompt"] == "hello there"


def test_no_prompt_reads_stdin_only_from_a_pipe_or_a_file(monkeypatch, tmp_path, capsys):
    """`tiered run` without PROMPT reads a pipe or a redirected file; stdin on /dev/null (nohup, cron, `docker run`
    without -i) or an empty pipe gives the default prompt (the latter with a note) where the first had failed with
    "the prompt read from stdin is empty"; '-' reading nothing is still refused."""
    import os
    from tiered import cli
    from tiered.errors import ConfigError

    def stdin_from(data: bytes | None):
        if data is None:
            return open(os.devnull)
        r, w = os.pipe()
        os.write(w, data)
        os.close(w)
        return os.fdopen(r)

    file = tmp_path / "prompt.txt"
    file.write_text("from a file\n")
    cases = [(open(os.devnull), cli.DEFAULT_PROMPT), (stdin_from(b"from a pipe\n"), "from a pipe"),
             (stdin_from(b""), cli.DEFAULT_PROMPT), (open(file), "from a file")]
    for stream, want in cases:
        with stream:
            monkeypatch.setattr("sys.stdin", stream)
            assert cli._prompt_text(None) == want
    assert "stdin is empty: using the default prompt" in capsys.readouterr().err
    with stdin_from(b"") as stream:
        monkeypatch.setattr("sys.stdin", stream)
        with pytest.raises(ConfigError, match="read from stdin is empty"):
            cli._prompt_text("-")


def test_an_unwritable_trace_path_is_refused_before_loading(runner, zoo, tmp_path):
    _bad(runner, ["run", "hi", "--model", str(zoo.dir("llama")), "-n", "2", "--trace",
                  str(tmp_path / "missing" / "t.json")], "--trace")


def test_stop_and_chat_need_a_tokenizer(rt):
    args = ["run", "5 6 7", "--model", str(rt.dir("mixtral")), "-n", "2", "--max-context", "64"]
    for extra in (["--stop", "x"], ["--chat"]):
        res = CliRunner().invoke(app, [*args, *extra])
        assert res.exit_code == 2 and "need" in res.output and "tokenizer" in res.output, res.output


def test_plan_takes_a_preset_as_its_profile_and_checks_its_lengths(runner, zoo):
    model = str(zoo.dir("llama"))  # 256 positions
    ok = runner.invoke(app, ["plan", "--model", model, "--profile", "t4-pcie3"])
    assert ok.exit_code == 0 and "profile: t4-pcie3" in ok.output, ok.output
    assert "prompt 128 tokens, 128 generated" in ok.output  # the defaults fit the model's positions
    _bad(runner, ["plan", "--model", model, "--prompt-tokens", "300"], "exceed the model's 256 positions")
    res = runner.invoke(app, ["plan", "--model", model, "--prompt-tokens", "0"])
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_plan_shows_the_plan_run_applies_to_a_checkpoint(runner, zoo):
    """`tiered plan --model CKPT` on this machine's kind of profile (no GPU here) is the plan `tiered run` makes
    for it (LLM.planned: a Q4_0 GGUF's int4 decode copies, fp32 compute, its mixed rows), where it had planned
    bf16 whatever the file held; --precision plans the asked format instead, and a GPU profile a CPU-only
    machine cannot run stays make_plan's what-if plan."""
    from pathlib import Path

    from tiered import LLM
    from tiered.config import EngineConfig
    from tiered.planner.auto import decisions
    from tiered.planner.plan import Plan

    prof = Path(__file__).parents[1] / ("benchmarks/results/sapphire-rapids-2026-12-02/at-1a1d96c/"
                                          "hardware_profile_this_machine.json")
    model = str(zoo.gguf("llama", "Q4_0"))
    out = runner.invoke(app, ["plan", "--model", model, "--profile", str(prof), "--json"])
    assert out.exit_code == 0, out.output
    shown = Plan.from_json(out.stdout)
    llm = LLM(model, EngineConfig(profile=str(prof)))
    try:
        assert decisions(shown) == decisions(llm.plan) and shown.precision == "int4" == llm.plan.precision
    finally:
        llm.close()
    asked = runner.invoke(app, ["plan", "--model", model, "--profile", str(prof), "--precision", "bf16", "--json"])
    assert asked.exit_code == 0 and Plan.from_json(asked.stdout).precision == "bf16", asked.output
    what_if = runner.invoke(app, ["plan", "--model", model, "--preset", "scheinfer-b", "--gpu-mem", "1GiB"])
    assert what_if.exit_code == 0 and "priced in bf16" in what_if.output and "tiered run" not in what_if.output


def test_plan_takes_run_s_expert_profile(runner, rt, tmp_path):
    """`tiered plan --expert-profile F` plans as `tiered run --expert-profile F` does (its popular experts placed
    first); a profile of the wrong shape is one clear error."""
    from pathlib import Path

    from tiered import LLM
    from tiered.config import EngineConfig
    from tiered.planner.auto import decisions
    from tiered.planner.plan import Plan

    prof = str(Path(__file__).parents[1] / "benchmarks/results/sapphire-rapids-2026-12-02/at-1a1d96c/"
                                          "hardware_profile_this_machine.json")
    from tiered.checkpoint import open_checkpoint

    model = str(rt.dir("mixtral"))
    cfg = open_checkpoint(model).config
    L, E = cfg.num_hidden_layers, cfg.num_experts
    counts = [[100.0 if e == L - 1 - i else 1.0 for e in range(E)] for i in range(L)]
    experts = tmp_path / "experts.json"
    experts.write_text(json.dumps({"tokens": counts}))
    # a RAM budget that leaves most experts on disk: the popular one of each layer is among those in RAM
    out = runner.invoke(app, ["plan", "--model", model, "--profile", prof, "--cpu-mem", "1500KiB",
                              "--expert-profile", str(experts), "--json"])
    assert out.exit_code == 0, out.output
    shown = Plan.from_json(out.stdout)
    want = LLM.planned(model, EngineConfig(profile=prof, cpu_memory="1500KiB", expert_profile=str(experts)))[0]
    assert decisions(shown) == decisions(want)
    assert all(l.expert_tiers[L - 1 - i] == "fast" for i, l in enumerate(shown.layers))
    assert "disk" in shown.layers[0].expert_tiers
    experts.write_text(json.dumps({"tokens": [[1.0] * (E + 1)] * L}))
    _bad(runner, ["plan", "--model", model, "--profile", prof, "--expert-profile", str(experts)], "expert profile")
    _bad(runner, ["plan", "--model", model, "--profile", prof, "--precision", "bf16", "--expert-profile",
                  str(experts)], "expert profile")


def test_settings_without_effect_are_noted(runner, zoo):
    res = runner.invoke(app, ["run", "hi", "--model", str(zoo.dir("llama")), "-n", "2", "--accelerator", "none",
                              "--gpu-mem", "1GB", "--threads", "4096", "--max-context", "100000"])
    assert res.exit_code == 0, res.output
    notes = [line for line in res.output.splitlines() if line.startswith("note: ")]
    assert len(notes) == 3 and "--gpu-mem is ignored" in notes[0] and "using 256" in notes[2], res.output


def test_structured_output_flags(runner, zoo, tmp_path):
    """`tiered run --choice / --regex / --json-schema FILE`: the output follows the constraint; two at once,
    a regex that does not compile and a beam search with one are one-line errors."""
    model = str(zoo.dir("llama"))
    res = runner.invoke(app, ["run", "the quick brown fox", "-m", model, "--choice", "alpha", "--choice", "beta",
                              "--json", "-t", "0.8", "--seed", "4"])
    assert res.exit_code == 0 and json.loads(res.stdout)["text"] in ("alpha", "beta"), res.output
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}))
    res = runner.invoke(app, ["run", "hello", "-m", model, "--json-schema", str(schema), "--json", "-t", "0"])
    assert res.exit_code == 0 and json.loads(json.loads(res.stdout)["text"]) in ({"ok": True}, {"ok": False}), res.output
    _bad(runner, ["run", "hi", "-m", model, "--choice", "a", "--regex", "b"], "--regex and --choice")
    _bad(runner, ["run", "hi", "-m", model, "--regex", "(ab"], "unclosed group")
    _bad(runner, ["run", "hi", "-m", model, "--regex", "a+", "--beams", "2"], "beam search")


def test_a_budget_short_of_the_models_window_takes_the_largest_that_fits(zoo, tmp_path):
    """No --max-context and a budget that cannot hold the KV cache of the model's positions: the engine halves the
    window down to the largest whose plan fits (LLM._fitted_context: here 8192 of 65536), says so in the plan and on
    `tiered run`'s stderr, and runs within it (a longer prompt is refused as over the window); a window given
    explicitly, or a budget that holds not even FIT_CONTEXT_FLOOR's, is refused as before."""
    import shutil

    from tiered import LLM, EngineConfig, SamplingParams
    from tiered.engine.llm import FIT_CONTEXT_FLOOR
    from tiered.errors import BudgetError, ContextLengthError

    d = tmp_path / "long"
    shutil.copytree(zoo.dir("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 65536}))
    base = dict(accelerator="none", decode_weights="fp32")
    fits = LLM.planned(d, EngineConfig(max_context=8192, **base))[0].memory["cpu"]
    budget = int(fits * 1.01)  # room for 8192 positions, not for 16384
    llm = LLM(d, EngineConfig(cpu_memory=budget, **base))
    try:
        assert llm.max_context == 8192 and llm.plan.context_tokens == 8192
        assert any("context window is 8192 tokens" in n for n in llm.plan.notes)
        assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0].token_ids) == 3
        with pytest.raises(ContextLengthError):
            llm.generate([[5] * 8192], SamplingParams(max_tokens=1))
    finally:
        llm.close()
    with pytest.raises(BudgetError):
        LLM(d, EngineConfig(cpu_memory=budget, max_context=65536, **base))
    tight = LLM.planned(d, EngineConfig(max_context=FIT_CONTEXT_FLOOR, **base))[0].memory["cpu"]
    with pytest.raises(BudgetError):
        LLM(d, EngineConfig(cpu_memory=tight // 2, **base))
    res = CliRunner().invoke(app, ["run", "5 6 7", "--model", str(d), "-n", "2", "--decode-weights", "fp32",
                                   "--cpu-mem", str(budget)])
    assert res.exit_code == 0 and "the context window is 8192 tokens" in res.output, res.output
