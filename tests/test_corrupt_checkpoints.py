"""Corrupt checkpoints and unwritable offload directories raise a tiered error naming the file (and
the tensor or field) at fault, never a traceback from safetensors, json, tokenizers or the models.

Each case copies a tiny checkpoint into tmp_path and damages one thing: a safetensors header
entry, tokenizer.json, config.json, model.safetensors.index.json, a GGUF header; or points the
experts' offload directory at a place that cannot be written.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from typer.testing import CliRunner

from fixtures import check, copy_dir
from runtime_fixtures import rt  # noqa: F401  (fixture)
from tiered import LLM, EngineConfig
from tiered.checkpoint import open_checkpoint
from tiered.cli import app
from tiered.errors import CheckpointError, ConfigError

TENSOR = "model.layers.0.self_attn.q_proj.weight"  # [64, 64] F32 in the tiny Llama


def read_header(f):
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_header(f, header, body):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def cli_error(args):
    """Run the CLI: it must fail with one `error: ... — fix` line, exit 2 and no traceback."""
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, res.output
    lines = [l for l in res.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and " — " in lines[0], res.output
    assert "Traceback" not in res.output
    return lines[0]


# ------------------------------------------------------------------------- safetensors headers
def _dtype_mismatch(h, body):
    h[TENSOR]["dtype"] = "BF16"  # 64x64 BF16 is 8192 bytes, its range holds 16384
    return body


def _unknown_dtype(h, body):
    h[TENSOR]["dtype"] = "Q9"
    return body


def _offsets_too_short(h, body):
    begin = h[TENSOR]["data_offsets"][0]
    h[TENSOR]["data_offsets"][1] = begin + 100  # the next tensor then starts after a gap
    return body


def _shape_too_big(h, body):
    h[TENSOR]["shape"] = [64, 128]
    return body


def _bad_shape(h, body):
    h[TENSOR]["shape"] = [64, -64]
    return body


def _no_offsets(h, body):
    del h[TENSOR]["data_offsets"]
    return body


CORRUPTIONS = {
    "dtype does not match the byte range": (_dtype_mismatch, ["BF16", "8192 bytes", "16384"]),
    "unknown dtype": (_unknown_dtype, ["unknown dtype 'Q9'"]),
    "offsets too short for the shape": (_offsets_too_short, ["16384 bytes", "hold 100"]),
    "shape too big for the offsets": (_shape_too_big, ["(64, 128)", "32768 bytes"]),
    "negative dimension": (_bad_shape, ["invalid shape"]),
    "no data_offsets": (_no_offsets, ["data_offsets"]),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_inconsistent_safetensors_header(zoo, tmp_path, case):
    """The header check verifies every tensor as the safetensors library would at its first load
    (which raised `SafetensorError: invalid shape, data type, or offset` from the loader)."""
    corrupt, words = CORRUPTIONS[case]
    d = copy_dir(zoo, "llama", tmp_path)
    f = d / "model.safetensors"
    header, body = read_header(f)
    write_header(f, header, corrupt(header, body))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(f), "corrupt", TENSOR, *words)


def test_tensors_must_cover_the_data_exactly(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    f = d / "model.safetensors"
    header, body = read_header(f)
    entries = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    second = entries[1][1]
    header[second]["data_offsets"] = [o + 4 for o in header[second]["data_offsets"]]  # a 4-byte gap...
    write_header(f, header, body)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(f), second, "gap of 4 bytes")
    header, _ = read_header(f)
    header[second]["data_offsets"] = [o - 8 for o in header[second]["data_offsets"]]  # ...an overlap
    write_header(f, header, body)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, second, "overlap of 4 bytes")
    header, _ = read_header(f)
    header[second]["data_offsets"] = [o + 4 for o in header[second]["data_offsets"]]
    write_header(f, header, body + b"\0" * 16)  # consistent again, but with bytes past the last tensor
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(f), "16 bytes past its last tensor")


def test_header_that_is_not_an_object(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    f = d / "model.safetensors"
    write_header(f, [1, 2, 3], b"")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(f), "not a valid safetensors file", "list")


def test_valid_checkpoints_still_open(zoo, rt):  # noqa: F811
    """The check accepts what safetensors writes, dense and MoE, sharded or not (with __metadata__)."""
    for d in (zoo.dir("llama"), rt.dir("mixtral"), rt.dir("qwen2_moe")):
        ck = open_checkpoint(d)
        assert ck.names() and ck.nbytes() > 0


def test_corrupt_header_at_the_command_line(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    f = d / "model.safetensors"
    header, body = read_header(f)
    write_header(f, header, _dtype_mismatch(header, body))
    for args in (["info", d], ["run", "hello", "--model", d, "-n", "3"]):
        line = cli_error(args)
        assert "model.safetensors is corrupt" in line and TENSOR in line


# ------------------------------------------------------------------------------- tokenizer.json
@pytest.mark.parametrize("content,words", [
    ("garbage{", ["not valid JSON"]),
    (json.dumps({"version": "1.0", "model": {"type": "NoSuchModel"}}), ["tokenizers library rejects it"]),
])
def test_corrupt_tokenizer_json(zoo, tmp_path, content, words):
    d = copy_dir(zoo, "llama", tmp_path)
    (d / "tokenizer.json").write_text(content)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d).tokenizer()
    check(e, str(d / "tokenizer.json"), "corrupt", *words)
    with pytest.raises(CheckpointError) as e:  # LLM() loads the tokenizer on a thread of its own: the same error
        LLM(d, EngineConfig(decode_weights="fp32"))
    check(e, str(d / "tokenizer.json"), "corrupt", *words)


def test_corrupt_tokenizer_at_the_command_line(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    (d / "tokenizer.json").write_text("garbage{")
    assert "tokenizer.json is corrupt" in cli_error(["run", "hello", "--model", d, "-n", "3"])


# ---------------------------------------------------------------------------------- config.json
def _edit_config(d, edit):
    f = d / "config.json"
    cfg = json.loads(f.read_text())
    cfg = edit(cfg)
    f.write_text(json.dumps(cfg))
    return f


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                                   "intermediate_size"])
def test_config_missing_a_required_field(zoo, tmp_path, field):
    d = copy_dir(zoo, "llama", tmp_path)
    f = _edit_config(d, lambda c: {k: v for k, v in c.items() if k != field})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(f), field, "missing")


@pytest.mark.parametrize("field,value,words", [
    ("hidden_size", "128", ["must be an integer", "'128'"]),
    ("hidden_size", 64.0, ["must be an integer"]),
    ("num_hidden_layers", True, ["must be an integer"]),
    ("num_attention_heads", 0, ["must be positive", "got 0"]),
    ("vocab_size", -5, ["must be positive"]),
    ("num_key_value_heads", "2", ["must be an integer"]),
    ("max_position_embeddings", [256], ["must be an integer"]),
    ("rms_norm_eps", "1e-6", ["must be a positive number"]),
    ("rope_theta", -1.0, ["must be a positive number"]),
    ("eos_token_id", "2", ["token id"]),
    ("rope_scaling", "linear", ["must be an object"]),
    ("rope_scaling", {"rope_type": "linear"}, ["rope_scaling.factor", "missing"]),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}, ["rope_scaling.low_freq_factor", "missing"]),
    ("head_dim", 0, ["must be positive"]),
])
def test_config_field_of_the_wrong_type_or_range(zoo, tmp_path, field, value, words):
    d = copy_dir(zoo, "llama", tmp_path)
    f = _edit_config(d, lambda c: {**c, field: value})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(f), field, *words)


def test_config_with_heads_that_do_not_divide_the_width(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    f = _edit_config(d, lambda c: {**c, "hidden_size": 4 * c["num_attention_heads"] + 1, "head_dim": None})
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(f), "hidden_size", "not a multiple of num_attention_heads")


def test_config_that_is_not_an_object(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(d / "config.json"), "JSON list")


def test_config_that_is_not_utf8(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    (d / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, "config.json", "not valid JSON")


def test_config_errors_at_the_command_line(zoo, tmp_path):
    d = copy_dir(zoo, "llama", tmp_path)
    good = json.loads((d / "config.json").read_text())
    _edit_config(d, lambda c: {**c, "hidden_size": str(c["hidden_size"])})
    assert "hidden_size must be an integer" in cli_error(["run", "hello", "--model", d, "-n", "3"])
    _edit_config(d, lambda c: {k: v for k, v in good.items() if k != "num_hidden_layers"})
    assert "num_hidden_layers is missing" in cli_error(["info", d])


# ------------------------------------------------------------------- model.safetensors.index.json
@pytest.mark.parametrize("content,words", [
    ("{\n", ["not valid JSON"]),
    (json.dumps({"metadata": {}}), ["weight_map"]),
    (json.dumps([1, 2]), ["weight_map"]),
    (json.dumps({"weight_map": {"a": 3}}), ["weight_map"]),
])
def test_malformed_index(zoo, tmp_path, content, words):
    d = copy_dir(zoo, "llama", tmp_path)
    index = d / "model.safetensors.index.json"
    index.write_text(content)
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(d)
    check(e, str(index), *words)


# -------------------------------------------------------------------------------------- GGUF
def test_gguf_of_an_unknown_version(zoo, tmp_path):
    f = tmp_path / "v99.gguf"
    data = bytearray(zoo.gguf("llama", "F32").read_bytes())
    data[4:8] = (99).to_bytes(4, "little")
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(f)
    check(e, str(f), "version 99")


# ---------------------------------------------------------------------------- offload directory
OFFLOAD = dict(dtype="float32", decode_weights="fp32", accelerator="none", plan="off", max_context=32,
               resident_experts=0, expert_cache_slots=2)


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_offload_dir_that_is_a_file(rt, tmp_path, weights):  # noqa: F811
    f = tmp_path / "a-file"
    f.write_text("keep me")
    for target, words in ((f, ["is a file, not a directory"]), (f / "sub", ["cannot be used", "Not a directory"])):
        with pytest.raises(ConfigError) as e:
            LLM(rt.dir("mixtral"), EngineConfig(offload_dir=str(target), expert_weights=weights, **OFFLOAD))
        check(e, str(target), *words)
        assert "writable --offload-dir with room for" in e.value.hint
    assert f.read_text() == "keep me"


def test_offload_dir_without_room(rt, tmp_path, monkeypatch):  # noqa: F811
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 20, 1 << 20, 1000))
    out = tmp_path / "off"
    with pytest.raises(ConfigError) as e:
        LLM(rt.dir("mixtral"), EngineConfig(offload_dir=str(out), expert_weights="bf16", **OFFLOAD))
    check(e, str(out), "1000 B free", "converted experts need")
    assert not out.exists()  # the directory it made is gone again


@pytest.mark.parametrize("weights", ["bf16", "int4"])
def test_failed_offload_write_leaves_nothing_behind(rt, tmp_path, monkeypatch, weights):  # noqa: F811
    """A write that fails midway (disk full) on the second layer's file: a ConfigError naming the
    directory and the cause, and neither the half-written file nor the first layer's is left."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:
                f.write(b"\0" * 100)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *a, **kw)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    out = tmp_path / "off"
    out.mkdir()
    (out / "unrelated.txt").write_text("x")
    with pytest.raises(ConfigError) as e:
        LLM(rt.dir("mixtral"), EngineConfig(offload_dir=str(out), expert_weights=weights, **OFFLOAD))
    check(e, str(out), "No space left on device")
    assert len(calls) == 2
    assert sorted(p.name for p in out.iterdir()) == ["unrelated.txt"]


def test_offload_dir_at_the_command_line(rt, tmp_path):  # noqa: F811
    f = tmp_path / "a-file"
    f.write_text("")
    # a RAM budget with room for the non-expert weights, 2 cache slots and staging but not all the
    # experts: some go to disk, in bf16, so they are converted into the offload directory
    budget = rt.sizes("mixtral").fast(cache_slots=2, resident=0, accelerator=False)
    line = cli_error(["run", "1 2 3", "--model", rt.dir("mixtral"), "--offload-dir", f, "--accelerator", "none",
                      "--plan", "off", "--max-context", "32", "--cpu-mem", budget, "--weights", "bf16",
                      "--cache-slots", "2", "-n", "2"])
    assert f"offload directory {f} is a file" in line and "--offload-dir with room for" in line
