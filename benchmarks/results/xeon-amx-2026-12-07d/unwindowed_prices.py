import sys
sys.path.insert(0, "benchmarks")
import cpu_gemma3
from tiered import LLM, EngineConfig
from tiered.checkpoint.model_config import ModelConfig
path = cpu_gemma3.model_file(6)
for P in (8192, 32768):
    llm = LLM(path, EngineConfig(max_context=P + 128))
    new = (llm.predicted_decode_at(P + 32), llm.predicted_ttft_at(P))
    orig = ModelConfig.window_of
    ModelConfig.window_of = lambda self, i: None
    old = (llm.predicted_decode_at(P + 32), llm.predicted_ttft_at(P))
    ModelConfig.window_of = orig
    print(P, "windowed", new, "unwindowed", old)
    del llm
