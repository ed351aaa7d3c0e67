import torch, torch.nn.functional as F
from tiered.models.layers import attend, _bf16_attention
torch.manual_seed(0)
for (H, Hkv, hd, T, past, W) in [(8, 4, 256, 300, 0, 0), (8, 4, 256, 300, 0, 128), (8, 4, 256, 200, 900, 1024), (4, 2, 64, 333, 70, 50), (4,4,32,65,0,1), (4,2,64,100,500,64), (9,3,64,513,0,0), (9,3,64,77,1000,0), (32,8,128,200,0,0)]:
    S = past + T
    q = torch.randn(1, T, H, hd).bfloat16().transpose(1, 2)
    k, v = (torch.randn(1, Hkv, S, hd).bfloat16() for _ in range(2))
    pos = torch.arange(past, S)
    keys = torch.arange(S)
    mask = (keys <= pos[:, None]) & ((keys > pos[:, None] - W) if W else True)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=hd ** -0.5, enable_gqa=True)
    tb = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=hd ** -0.5, enable_gqa=True)
    got = attend(q, k, v, mask, False, hd ** -0.5, True, past, W)
    print(H, hd, T, past, W, "native", _bf16_attention(q, k, v, past) is not None, "err %.5f" % (got.float() - ref).abs().max().item(), "torch bf16 err %.5f" % (tb.float() - ref).abs().max().item())
