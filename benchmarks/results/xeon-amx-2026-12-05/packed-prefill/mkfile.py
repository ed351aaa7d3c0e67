import sys; sys.path.insert(0, "benchmarks")
from pathlib import Path
from batch_file import write_file
from tiered.checkpoint import default_model_path, open_checkpoint
model = str(default_model_path()); ck = open_checkpoint(model)
print(model)
l = write_file(Path("/tmp/s84/req.jsonl"), 48, 115, 32, ck.config.vocab_size, Path(model).stem)
print(sum(g for _, g in l))
