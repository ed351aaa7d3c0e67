"""Measured runs as ground truth: replay a file of measured configurations through `make_plan` on
the measuring machine's HardwareProfile and compare the plan's predictions with the measurements.

A reference file (JSON, e.g. benchmarks/reference/h200-2026-11-22/measured.json) holds:
    source, machine, method, context    where the numbers come from and how they were taken
    profile                             that machine's `tiered profile` JSON (path relative to the file)
    plans                               make_plan arguments: "all" rows, "decode" and "ttft" predictions
    models                              name -> HF-style config.json fields (keys starting "_" are notes)
    library_workspace                   GPU bytes the measured engine kept for cuBLAS's workspaces (make_plan's
                                        library_workspace; default 0: the runs before 2026-11-26's session 25
                                        kept none; null: the profile GPU's, as the engine now keeps)
    rows                                name, model, plan (make_plan arguments: budgets, forced dispatch,
                                        fixed placement), accelerator ("none" = no GPU tier, as
                                        `EngineConfig(accelerator="none")` plans), measured
                                        {decode_tokens_per_s, ttft_s}, comparable (false: the runtime
                                        has changed since), expert_profile (a routing profile
                                        beside the file, as --expert-profile plans with it), note
Decode is predicted with the measurement's own prompt and generation lengths (its context), TTFT
with its prompt; both plans keep the same budgets and KV room, so their placement is the same.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tiered.checkpoint.model_config import ModelConfig
from tiered.hardware.profile import HardwareProfile
from tiered.planner.make import make_plan

METRICS = ("decode_tokens_per_s", "ttft_s")


def load_reference(path: str | Path) -> tuple[dict, HardwareProfile]:
    """(the reference file's content, the measuring machine's HardwareProfile)."""
    path = Path(path)
    ref = json.loads(path.read_text())
    ref["_dir"] = str(path.parent)
    return ref, HardwareProfile.load(path.parent / ref["profile"])


def model_config(ref: dict, name: str) -> ModelConfig:
    return ModelConfig.from_hf({k: v for k, v in ref["models"][name].items() if not k.startswith("_")})


def predict_row(ref: dict, row: dict, profile: HardwareProfile) -> dict:
    """The plans' predictions for one row: {"decode_tokens_per_s", "ttft_s", "plan": summary line}."""
    cfg = model_config(ref, row["model"])
    if row.get("accelerator") == "none":  # as engine_plan: no GPU tier, CPU RAM is the fast tier
        profile = replace(profile, gpu_memory=None)
    # runs measured before the plans kept cuBLAS's workspaces in the budget (2026-11-26) planned without them
    base = dict({"library_workspace": ref.get("library_workspace", 0)}, **ref["plans"].get("all", {}), **row.get("plan", {}))
    if row.get("expert_profile"):  # `tiered profile-experts` output beside the file, as --expert-profile
        from tiered.planner.placement import load_popularity
        base["popularity"] = load_popularity(Path(ref["_dir"]) / row["expert_profile"], cfg.num_hidden_layers,
                                             cfg.num_experts)
    decode = make_plan(cfg, profile, model_name=row["model"], **dict(base, **ref["plans"]["decode"]))
    ttft = make_plan(cfg, profile, model_name=row["model"], **dict(base, **ref["plans"]["ttft"]))
    return {"decode_tokens_per_s": decode.predicted_decode_tokens_per_s, "ttft_s": ttft.predicted_ttft_s,
            "plan": decode.summary()}


def compare(ref: dict, profile: HardwareProfile) -> list[dict]:
    """Every row with its prediction and the relative error of each metric, |predicted - measured| /
    measured (None where the row is not comparable)."""
    out = []
    for row in ref["rows"]:
        pred = predict_row(ref, row, profile)
        errors = {m: abs(pred[m] - row["measured"][m]) / row["measured"][m] if row.get("comparable", True) else None
                  for m in METRICS}
        out.append({"name": row["name"], "config": row.get("config", ""), "model": row["model"],
                    "comparable": row.get("comparable", True), "note": row.get("note", ""),
                    "measured": {m: row["measured"][m] for m in METRICS},
                    "predicted": {m: pred[m] for m in METRICS}, "error": errors, "plan": pred["plan"]})
    return out
