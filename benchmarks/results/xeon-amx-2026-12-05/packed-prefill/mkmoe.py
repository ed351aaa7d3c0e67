import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
from batch_file import write_file
from tiered.checkpoint import open_checkpoint
for name in ("q8moe", "q8moe-few"):
    ck = open_checkpoint(f"/tmp/s83/moe/{name}.gguf")
    l = write_file(Path(f"/tmp/s84/req-{name}.jsonl"), 24, 64, 16, ck.config.vocab_size, name)
    print(name, sum(p for p, _ in l), sum(g for _, g in l))
