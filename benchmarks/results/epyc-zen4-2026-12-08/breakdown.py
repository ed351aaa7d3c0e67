import sys
from tiered import LLM, EngineConfig
from tiered.planner.cpu_predict import predict_decode
path = sys.argv[1]
llm = LLM(path, EngineConfig())
plan, cfg, hw = llm.plan, llm.config, llm._profile
print("experts", plan.dtypes["experts"], "mix", plan.precision_mix, "head", plan.dtypes.get("lm_head"), "act", plan.expert_act)
layers, step = predict_decode(cfg, hw, plan.precision, context=80, experts_format=plan.dtypes["experts"],
                              head_dtype=plan.dtypes.get("lm_head"), expert_act=plan.expert_act, mix=plan.precision_mix,
                              kv_format=plan.dtypes["kv_cache"], batch_act=plan.batch_act, bursts=True)
a = sum(x for x, _ in layers); f = sum(y for _, y in layers)
print(f"step {step*1e3:.2f} ms: attn {a*1e3:.2f} ffn/moe {f*1e3:.2f} rest(head+step) {(step-a-f)*1e3:.2f}")
