import time, tempfile, sys
from tiered.hardware.profiler import profile_machine, PROFILER_VERSION
t = time.perf_counter()
p = profile_machine(quick=True, disk_dir=tempfile.mkdtemp(), cuda=False)
print(PROFILER_VERSION, "quick profile", round(time.perf_counter() - t, 1), "s", len(p.models), "keys", flush=True)
