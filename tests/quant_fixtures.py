"""Quantized checkpoints written once per test module, beside the fp32 checkpoints of the weights their
codes encode, and transformers' models of those (the golden reference of every quantized-format test:
tests/test_int4_checkpoints.py, test_int8_checkpoints.py, test_bnb_checkpoints.py), and copies of them
altered for the error tests (also test_fp8_channel.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import torch

from fixtures import load_hf_model, write_tiny_checkpoint
from moe_fixtures import VOCAB, build_hf_moe_model, load_hf_moe_model


class QuantZoo:
    """Checkpoints of (kind, scheme) under `root`, each written once.

    Args:
        root: a directory of the test session's.
        write: (source dir, destination dir, scheme) -> (quantized dir, reference dir): the scheme's
            writer, which quantizes the source's weights and saves, as reference, the fp32 weights the
            codes encode.
        dense: the kind written by fixtures.write_tiny_checkpoint; every other kind is a tiny MoE
            (moe_fixtures.build_hf_moe_model with `moe_changes`, e.g. widths of a multiple of 128).
    """

    def __init__(self, root: Path, write: Callable[[Path, Path, str], tuple[Path, Path]], dense: str,
                 **moe_changes) -> None:
        self.root, self.write, self.dense, self.moe_changes = root, write, dense, moe_changes
        self._made: dict[tuple[str, str], tuple[Path, Path]] = {}
        self._hf: dict[tuple[str, str], object] = {}

    def get(self, kind: str, scheme: str) -> tuple[Path, Path]:
        """(the quantized checkpoint's dir, its fp32 reference's dir)."""
        key = (kind, scheme)
        if key not in self._made:
            src = self.root / kind
            if not src.is_dir():
                if kind == self.dense:
                    write_tiny_checkpoint(kind, src)
                else:
                    build_hf_moe_model(kind, VOCAB, **self.moe_changes).save_pretrained(src, safe_serialization=True)
            self._made[key] = self.write(src, self.root / f"{kind}-{scheme}", scheme)
        return self._made[key]

    def hf(self, kind: str, scheme: str):
        """transformers' model (fp32, eager attention) of the reference weights, loaded once."""
        key = (kind, scheme)
        if key not in self._hf:
            ref = self.get(kind, scheme)[1]
            self._hf[key] = load_hf_model(ref) if kind == self.dense else load_hf_moe_model(ref)
        return self._hf[key]


def write_quantized(src: Path, dst: Path, quantization_config: dict,
                    quantize: Callable[[str, torch.Tensor], tuple[dict, torch.Tensor] | None]) -> tuple[Path, Path]:
    """`src` (a one-file safetensors checkpoint) with each tensor `quantize` takes replaced by its parts
    (dst, with `quantization_config` in its config.json), and the weights those parts encode as a plain
    fp32 checkpoint (dst-dequantized): the oracle's. Returns (dst, the reference's dir).

    quantize: (name, weight) -> None to keep the tensor as it is, or ({suffix: tensor} stored as
        `<module>.<suffix>` where the weight is `<module>.weight`, the weight they encode)."""
    from safetensors.torch import load_file, save_file

    ref_dir = dst.with_name(dst.name + "-dequantized")
    for d in (dst, ref_dir):
        shutil.copytree(src, d)
    out, ref = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        q = quantize(name, w)
        if q is None:
            out[name] = ref[name] = w
            continue
        parts, ref[name] = q
        base = name[:-len(".weight")]
        out.update({f"{base}.{k}": v for k, v in parts.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref_dir


def edited(src: Path, out: Path, config=None, tensors=None) -> Path:
    """A copy of checkpoint dir `src` at `out`, its config.json's quantization_config changed in place by
    `config(qc)` and its model.safetensors' tensors (a dict) by `tensors(t)`: a damaged or altered
    checkpoint for the error tests."""
    shutil.copytree(src, out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors:
        from safetensors.torch import load_file, save_file

        f = out / "model.safetensors"
        t = load_file(str(f))
        tensors(t)
        save_file(t, str(f), metadata={"format": "pt"})
    return out
