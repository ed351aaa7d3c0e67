# Fit t = a + b MACs + c weights (relative NNLS) to amx_shapes.py's points and compare with the prices of a profile's
# old gemm_amx + dequantize terms (constants below). Usage: python fit_shapes.py amx_shapes.json
import json, sys, numpy as np
from scipy.optimize import nnls
pts = json.load(open(sys.argv[1]))
A = np.array([[1.0, N*K*M, N*K] for N, K, M, t in pts]); y = np.array([t for *_, t in pts])
# relative least squares: weight by 1/t
W = 1 / y
sol, _ = nnls(A * W[:, None], y * W)
print("a=%.3g s, b=%.3g s/mac (%.0f GMAC/s), c=%.3g s/weight" % (sol[0], sol[1], 1e-9/sol[1] if sol[1] else 0, sol[2]))
cur_b, cur_dq = 2.226e-12, 1.076e-10
for (N, K, M, t), p in zip(pts, A @ sol):
    cur = cur_b*N*K*M + cur_dq*N*K
    print(f"{N:6d}x{K:<6d}@{M:4d} meas {t*1e3:7.3f} fit {p*1e3:7.3f} ({p/t-1:+.0%}) cur {cur*1e3:7.3f} ({cur/t-1:+.0%})")
