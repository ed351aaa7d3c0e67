import sys
from tiered import LLM, EngineConfig
for p in sys.argv[1:]:
    l = LLM(p, EngineConfig())
    print(p.split("-")[6], l.plan.dtypes["experts"], {T: round(l.predicted_ttft_at(T), 3) for T in (32, 128, 512)})
    l.close()
