"""The benchmark harness every script in benchmarks/ shares.

    machine.py     the machine and versions a result came from (machine_info, describe)
    timing.py      medians of repeats; decode tok/s as (N-1)/(t(N)-t(1)), prefill excluded
    memory.py      peak memory per tier over a block (GPU allocated bytes, process RSS)
    checkpoint.py  dummy-weight checkpoints at real layer shapes (Mixtral-8x7B, Llama-3-8B slices)
    runners.py     tiered and transformers behind one interface: TTFT and decode of a prompt
    report.py      results/NAME.json (machine, versions, settings, rows) and NAME.md (a table)
    child.py       probes that run each configuration in a process of its own (their options and call)
"""

from tiered.bench.checkpoint import ModelShape, llama3_8b, mixtral_8x7b, write_dummy_checkpoint
from tiered.bench.machine import describe, machine_info
from tiered.bench.memory import PeakMemory
from tiered.bench.report import Column, markdown_table, write_report
from tiered.bench.timing import decode_tokens_per_s, median, repeat, timed

__all__ = ["ModelShape", "llama3_8b", "mixtral_8x7b", "write_dummy_checkpoint", "describe", "machine_info",
           "PeakMemory", "Column", "markdown_table", "write_report", "decode_tokens_per_s", "median", "repeat",
           "timed"]
