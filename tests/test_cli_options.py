"""The engine options `run`, `chat`, `serve` and `batch` share (tiered/cli.engine_options): declared once, every
command takes each of them, and what a command line gives reaches the EngineConfig it builds."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from tiered import cli
from tiered.cli import ENGINE_OPTIONS, app

COMMANDS = ("run", "chat", "serve", "batch")


class _Stop(Exception):
    """Raised by the patched _engine_config: the command's options were read, nothing loads."""


@pytest.fixture
def captured(monkeypatch):
    seen = {}

    def grab(args, **kw):
        seen.update(args=dict(args), **kw)
        raise _Stop

    monkeypatch.setattr(cli, "_engine_config", grab)
    return seen


def test_every_generating_command_takes_every_engine_option():
    group = typer.main.get_command(app)
    for name in COMMANDS:
        params = {p.name for p in group.commands[name].params}
        assert set(ENGINE_OPTIONS) <= params, (name, set(ENGINE_OPTIONS) - params)
        assert "engine_opts" not in params  # the dict the command receives, not an option


def test_the_engine_options_given_reach_the_command(captured):
    res = CliRunner().invoke(app, ["run", "hi", "--kv-cache-dtype", "int8", "--threads", "1", "--gpu-mem", "1GiB",
                                   "--no-read-ahead", "--trace", "t.json", "--beams", "2"])
    assert isinstance(res.exception, _Stop), res.output
    args = captured["args"]
    assert set(args) == set(ENGINE_OPTIONS)
    assert (args["kv_cache_dtype"], args["threads"], args["gpu_mem"], args["read_ahead"]) == ("int8", 1, "1GiB", False)
    assert args["dtype"] == "auto" and args["plan"] == "auto"  # the rest at their defaults
    assert captured["trace"] is True and captured["max_batch"] == 2  # the command's own options stay its own


def test_batch_keeps_its_own_max_context(captured, tmp_path):
    """batch declares --max-context itself (its default: what the file's requests need): the engine gets the file's
    need where none is given, the value given where one is."""
    f = tmp_path / "requests.jsonl"
    body = {"model": "x", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5}
    f.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    for extra, check in (([], lambda n: 0 < n < 100), (["--max-context", "300"], lambda n: n == 300)):
        res = CliRunner().invoke(app, ["batch", str(f), "--served-model-name", "x", *extra])
        assert isinstance(res.exception, _Stop), res.output
        assert check(captured["args"]["max_context"]), captured["args"]["max_context"]
