"""Structured outputs (engine/structured.py): what constraining decode to a JSON schema, any JSON object or a
regex costs a token, against the same engine unconstrained, and whether every output follows its constraint.

Loads the default model (SmolLM2-135M-Instruct) once and decodes greedily `--tokens` tokens at most for each
prompt in each mode, the modes alternated for `--rounds` rounds in one process (this VM's speed moves within
minutes). The unconstrained baseline runs twice: as `generate` runs it (a lone request decodes in native
bursts, LLM._burst) and one step a token (LLM.bursts off), the way every constrained sequence decodes (its
grammar masks each draw in Python). The JSON schema runs twice: the tokens its grammar forces (key names) fed
as rows of the next step (LLM._force), and drawn a step each (TIERED_FORCED_TOKENS=0). Writes
structured_outputs.{json,md} to --out; quote the medians.

    python benchmarks/structured_outputs.py --out benchmarks/results/<machine-date>/structured_outputs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tiered import LLM, SamplingParams  # noqa: E402
from tiered.bench import Column, write_report  # noqa: E402

# bounded strings and list, as a user asks a small model that repeats itself greedily (SmolLM2-135M fills an
# unbounded list with one hobby until max_tokens)
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 30},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
PROMPTS = ["Describe a person named Alice who lives in Paris as JSON.",
           "Give me a JSON object for a retired teacher from Oslo.",
           "Make up a character for a novel and write it as JSON.",
           "Write the profile of a 30-year-old software engineer as JSON."]
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"


def _follows(mode: str, text: str) -> bool:
    """Whether `text` follows mode's constraint (checked here, not by the grammar engine)."""
    if mode.startswith("json schema"):
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return (isinstance(obj, dict) and set(obj) == set(PERSON["properties"]) and isinstance(obj["age"], int)
                and all(isinstance(obj[k], str) for k in ("name", "city")) and isinstance(obj["hobbies"], list))
    if mode == "json object":
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if mode == "regex (a date)":
        return re.fullmatch(DATE, text) is not None
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=160, help="most tokens a request")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results" / "structured_outputs"))
    args = ap.parse_args()

    llm = LLM()
    modes = {"unconstrained, bursts": None, "unconstrained, a step a token": None,
             "json schema": {"json": PERSON}, "json schema, forced tokens a step each": {"json": PERSON},
             "json object": {"json_object": True}, "regex (a date)": {"regex": DATE}}
    itl: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[int]] = {m: [] for m in modes}
    follows: dict[str, list[bool]] = {m: [] for m in modes}
    stopped: dict[str, list[bool]] = {m: [] for m in modes}
    llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, structured_outputs={"json": PERSON}))
    for _ in range(args.rounds):
        for mode, so in modes.items():
            llm.bursts = mode != "unconstrained, a step a token"
            # the grammar's forced tokens as rows of the next step (LLM._force), or drawn a step each
            os.environ["TIERED_FORCED_TOKENS"] = "0" if mode.endswith("a step each") else "1"
            for prompt in PROMPTS:
                out = llm.generate([[{"role": "user", "content": prompt}]], SamplingParams(
                    max_tokens=args.tokens, temperature=0, structured_outputs=so, ignore_eos=so is None))[0]
                itl[mode].append(out.stats.itl_s)
                tokens[mode].append(len(out.token_ids))
                follows[mode].append(_follows(mode, out.text))
                stopped[mode].append(out.finish_reason == "stop")
    llm.bursts = True
    rows = []
    for mode in modes:
        rows.append({"mode": mode, "requests": len(itl[mode]), "median_tokens": statistics.median(tokens[mode]),
                     "median_itl_ms": 1e3 * statistics.median(itl[mode]),
                     "tokens_per_s": 1 / statistics.median(itl[mode]),
                     "follows": f"{sum(follows[mode])}/{len(follows[mode])}",
                     "stopped": f"{sum(stopped[mode])}/{len(stopped[mode])}"})
    step = rows[1]["median_itl_ms"]
    for r in rows:
        r["vs_a_step_a_token"] = step / r["median_itl_ms"]
    columns = [Column("mode", "mode"), Column("requests", "requests"), Column("median tokens", "median_tokens"),
               Column("median ITL ms", "median_itl_ms", "{:.2f}"), Column("decode tok/s", "tokens_per_s", "{:.1f}"),
               Column("speed vs unconstrained a step a token", "vs_a_step_a_token", "{:.2f}x"),
               Column("follows its constraint", "follows"), Column("ended by the grammar or EOS", "stopped")]
    json_path, md_path = write_report(
        "structured_outputs", args.out, title="Structured outputs: the cost of a constrained token",
        settings=vars(args) | {"schema": PERSON, "regex": DATE, "prompts": PROMPTS}, rows=rows, columns=columns,
        notes=["Greedy decode of each prompt (chat template) for at most `tokens` tokens, the modes alternated in "
               "one process, median inter-token latency over every request of the mode (a forced token's time is "
               "its step's: the tokens of one step share it). The unconstrained rows ignore EOS (they run all "
               "`tokens`); a constrained request ends when its grammar completes.",
               "follows: checked with Python's json / re, not by the grammar engine."])
    print(md_path.read_text())


if __name__ == "__main__":
    main()
