import sys, json
from tiered.hardware import profiler as P
from tiered.hardware.profiler import _decode_ws_points
import torch
torch.set_num_threads(2)
code = json.load(open('/root/.cache/tiered/hardware_profile.json'))['models']['runtime/decode_step/bf16']['beta']
for shape in [tuple(map(int, s.split(','))) for s in sys.argv[1:]]:
    pts = _decode_ws_points(3, 480 * 2**20, shape=shape, layer_code=code, sets_mib=(32, 64, 128, 256, 512))
    print(shape, [(round(x / 2**20), round(t * 1e12, 2)) for x, t in pts], flush=True)
