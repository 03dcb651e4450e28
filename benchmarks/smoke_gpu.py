"""Quick GPU accuracy smoke: a few shapes, both implementations, against the float64 reference."""
import sys
import time

import torch

from mamba3_mimo.accuracy import check_outputs, format_checks
from mamba3_mimo.api import bwd_fwd
from mamba3_mimo.inputs import make_inputs
from mamba3_mimo.reference import bwd_fwd_reference

CASES = [
    dict(B=2, S=64, H=4, G=2, N=32, P=32, R=2, chunk_size=16, dtype=torch.float32, z=True, d=True),
    dict(B=1, S=50, H=2, G=1, N=64, P=48, R=3, chunk_size=16, dtype=torch.bfloat16, z=True, d=False),
    dict(B=2, S=64, H=2, G=2, N=16, P=64, R=4, chunk_size=8, dtype=torch.float16, z=False, d=True),
    dict(B=2, S=512, H=4, G=1, N=128, P=64, R=4, chunk_size=16, dtype=torch.bfloat16, z=True, d=True),
    dict(B=2, S=512, H=4, G=1, N=256, P=128, R=8, chunk_size=8, dtype=torch.bfloat16, z=True, d=True),
    dict(B=1, S=512, H=4, G=1, N=128, P=64, R=1, chunk_size=64, dtype=torch.float32, z=True, d=True),
    # rows = 64 with a 32-wide P tile: the shape that faulted on commit 9df55fc.
    dict(B=1, S=256, H=2, G=1, N=128, P=32, R=4, chunk_size=16, dtype=torch.bfloat16, z=True, d=True),
]
failed = 0
for i, case in enumerate(CASES):
    out_dtype = torch.bfloat16 if case["dtype"] == torch.bfloat16 else torch.float32
    inputs = make_inputs(**case, device="cuda", seed=100 + i)
    golden = bwd_fwd_reference(**inputs, compute_dtype=torch.float64)
    bench = bwd_fwd_reference(**inputs, compute_dtype=case["dtype"])
    for impl in ("production", "stage0"):
        t = time.time()
        out = bwd_fwd(**inputs, output_dtype=out_dtype, impl=impl)
        torch.cuda.synchronize()
        checks = check_outputs(out, golden, bench, case["dtype"], out_dtype)
        ok = all(c.passed for c in checks)
        failed += not ok
        print(f"== {impl} {case} out={out_dtype} {'PASS' if ok else 'FAIL'} ({time.time() - t:.1f}s)")
        print(format_checks(checks))
print(f"{len(CASES) * 2 - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
