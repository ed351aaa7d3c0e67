"""Probes that run each configuration in a process of its own (fresh allocator statistics, OpenMP and
CUDA settings from the environment): the parent's argument parser and its call of one child.

    ap = probe_parser(__doc__, CONFIGS)                      # --out, --configs, --profile, --smoke, --child
    result, error = run_child(__file__, name, out, a)         # the child prints one JSON line last
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def probe_parser(doc: str, configs) -> argparse.ArgumentParser:
    """An ArgumentParser with a probe's common options: --out DIR, --configs (comma list of `configs`),
    --profile (the plans' hardware profile), --smoke (the host stand-in at tiny shapes) and the hidden
    --child NAME the parent runs each configuration as."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default=",".join(configs), help="comma list of: " + ", ".join(configs))
    ap.add_argument("--profile", help="hardware profile JSON the plans use")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the host stand-in (no GPU): checks the probe runs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap


def run_child(script: str | Path, name: str, out: Path, args: argparse.Namespace,
              env: dict | None = None) -> tuple[dict | None, str]:
    """Run `script --child name` (with the parent's --out, --profile, --smoke) in a new Python process
    and parse the JSON object its last stdout line holds. Returns (that object, "") or (None, the
    child's return code and the end of its stderr or stdout) when it printed none."""
    cmd = [sys.executable, str(script), "--out", str(out), "--child", name] \
        + (["--profile", args.profile] if args.profile else []) + (["--smoke"] if args.smoke else [])
    p = subprocess.run(cmd, env=env if env is not None else dict(os.environ), capture_output=True, text=True)
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        return json.loads(last), ""
    except json.JSONDecodeError:
        return None, f"rc {p.returncode}\n{(p.stderr or p.stdout)[-3000:]}"
