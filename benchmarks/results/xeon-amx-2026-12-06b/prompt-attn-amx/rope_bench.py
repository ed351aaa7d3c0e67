import torch, time, statistics as st
from tiered import kernels
from tiered.models.layers import RMSNorm, apply_rotary
ext = kernels.load()
B,T,H,hd = 1,512,32,128
qkv = torch.randn(B,T,5120).bfloat16()
q = qkv[..., :4096].view(B,T,H,hd).transpose(1,2)
cos = torch.randn(B,1,T,hd); sin = torch.randn(B,1,T,hd)
n = RMSNorm(hd, 1e-6); n.weight.data = torch.rand(hd) + 0.5; n.weight.requires_grad_(False)
def tm(f, k=30):
    f(); ts=[]
    for _ in range(k):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return st.median(ts)*1e3
with torch.no_grad():
    a = ext.rope(q, cos, sin, n.weight, n.eps)
    ref = apply_rotary(n(q.float()), cos, sin).bfloat16()
    print("equal to fp32 passes:", torch.equal(a, ref))
    qf = q.float()
    print("fused bf16 %.3f ms" % tm(lambda: ext.rope(q, cos, sin, n.weight, n.eps)))
    print("fused fp32 %.3f ms" % tm(lambda: ext.rope(qf, cos, sin, n.weight, n.eps)))
    print("rope only bf16 %.3f ms" % tm(lambda: ext.rope(q, cos, sin)))
    print("old: norm fp32 + rope fp32 + to bf16 %.3f ms" % tm(lambda: ext.rope(n(qf.transpose(1,2)).transpose(1,2), cos, sin).bfloat16()))
