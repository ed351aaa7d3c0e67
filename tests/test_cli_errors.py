"""Bad input at the command line: one `error: ... — fix` line on stderr, exit status 2, no traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

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
