"""Probes that run each configuration in a process of its own (fresh allocator statistics, OpenMP and
CUDA settings from the environment): the parent's argument parser and its call of one child.

    ap = probe_parser(__doc__, CONFIGS)                      # --out, --configs, --profile, --smoke, --child
    result, error = run_child(__file__, name, out, a)         # the child prints one JSON line last
    return probe_main(__file__, __doc__, CONFIGS, child, title, section, "stem")  # all of a probe's main:
                                                              # child(name, options) -> the result dict
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


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


def probe_main(script: str | Path, doc: str, configs, child: Callable[[str, argparse.Namespace], dict], title: str,
               section: Callable[[dict], list[str]], stem: str, argv: list[str] | None = None,
               env_option: bool = False) -> int:
    """A probe's main: with --child NAME, print child(NAME, the parsed options) as one JSON line; else run
    each configuration in its own process (run_child) and write OUT/STEM.md (`title`, then per
    configuration a "## name (seconds)" header and section(result), or why it failed) and OUT/STEM.json
    (the results). `env_option`: a repeatable --env NAME=VALUE for the children's environment, named in
    the title. Returns the exit status (0)."""
    ap = probe_parser(doc, configs)
    if env_option:
        ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the child processes (repeatable)")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.child:
        print(json.dumps(child(a.child, a)), flush=True)
        return 0
    env = None
    if env_option:
        env = dict(os.environ, **dict(e.split("=", 1) for e in a.env))
        title = f"{title} ({','.join(a.env) or 'default environment'})"
    lines, results = [f"# {title}", ""], []
    for name in a.configs.split(","):
        t0 = time.perf_counter()
        r, error = run_child(script, name, out, a, env)
        if r is None:
            lines += [f"## {name}: failed ({error.splitlines()[0]})", "```", error, "```", ""]
            continue
        results.append(r)
        lines += [f"## {name} ({time.perf_counter() - t0:.0f} s)", ""] + section(r) + [""]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0
