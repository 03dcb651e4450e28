"""Where chunk_scan's 16-wide P tile miscompiles on the GPU (docs/optimization.md section 45).

Each config runs in its own process (an illegal address poisons the CUDA context) under CUDA_LAUNCH_BLOCKING=1, against
the accuracy contract of the tests (``run_and_check``).  Sets:
  knobs     the failing half-rotation test case (N = 64, R = 4, 16-wide tiles, qk_dot deferred) with one thing changed
            at a time, fp16 then bf16; and the dispatcher's N = 128, P = 128 configs (qk_dot deferred) at five (R, C).
  map       16-wide tiles at N = 32 / 64 over six (C, R), bf16; and the dispatcher's configs at P = 16.

usage: PYTHONPATH=$PWD python3 benchmarks/probe_narrow_p_tile.py knobs|map
"""
import dataclasses
import os
import subprocess
import sys

import torch

KNOB_VARIANTS = {
    "dqk-split-R4-half": (4, dict(out_defer_qk_dot=True, out_half_rotation=True)),
    "split-R4-half": (4, dict(out_half_rotation=True)),
    "dqk-split-R4": (4, dict(out_defer_qk_dot=True)),
    "dqk-split-R4-half-o32": (4, dict(out_defer_qk_dot=True, out_half_rotation=True, out_block_p=32)),
    "dqk-split-R2-half": (2, dict(out_defer_qk_dot=True, out_half_rotation=True)),
    "split-R4-o16-plain": (4, dict()),
}
RULE_SHAPES = [(1, 64), (2, 32), (4, 8), (4, 16), (8, 8)]  # (R, C) at N = 128, P = 128
MAP = [(n, c, r) for n in (32, 64) for c, r in ((16, 4), (32, 2), (8, 8), (64, 1), (16, 2), (32, 4))]
DISPATCH_P16 = [(n, c, r) for n in (16, 32, 64, 128) for c, r in ((16, 4), (32, 2), (8, 8))]


def names(which):
    if which == "knobs":
        return list(KNOB_VARIANTS) + [f"rule-{r}-{c}" for r, c in RULE_SHAPES]
    return [f"map-{n}-{c}-{r}" for n, c, r in MAP] + [f"dispatch-{n}-{c}-{r}" for n, c, r in DISPATCH_P16]


def run_one(name):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from conftest import run_and_check

    from mamba3_mimo.ops.production import ScanConfig, choose_config
    narrow = ScanConfig(block_p=16, n_segments=2, out_block_p=16, local_states=True, split_gate=True)
    bf16 = dict(device="cuda", dtype=torch.bfloat16, output_dtype=torch.bfloat16)
    if name in KNOB_VARIANTS:
        R, knobs = KNOB_VARIANTS[name]
        for dtype in (torch.float16, torch.bfloat16):
            run_and_check("production", device="cuda", seed=11, dtype=dtype,
                          config=dataclasses.replace(narrow, **knobs), B=1, S=70, H=2, G=1, N=64, P=48, R=R,
                          chunk_size=16)
        return
    kind, *sizes = name.split("-")
    if kind == "rule":
        R, C = map(int, sizes)
        config = choose_config(B=4, H=16, S=2048, N=128, P=128, R=R, chunk_size=C, num_sms=132, has_z=True)
        assert config.out_defer_qk_dot, config
        run_and_check("production", seed=7, config=config, B=2, S=300, H=4, G=1, N=128, P=128, R=R, chunk_size=C,
                      **bf16)
        return
    N, C, R = map(int, sizes)
    if kind == "map":
        run_and_check("production", seed=5, config=narrow, B=2, S=70, H=2, G=1, N=N, P=48, R=R, chunk_size=C, **bf16)
        return
    config = choose_config(B=2, H=4, S=300, N=N, P=16, R=R, chunk_size=C, num_sms=132, has_z=True)
    run_and_check("production", seed=5, config=config, B=2, S=300, H=4, G=1, N=N, P=16, R=R, chunk_size=C, **bf16)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        run_one(sys.argv[2])
        return
    if len(sys.argv) != 2 or sys.argv[1] not in ("knobs", "map"):
        sys.exit(__doc__)
    for name in names(sys.argv[1]):
        done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                              env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
        why = [line for line in (done.stdout + done.stderr).splitlines() if "Error:" in line or "violated" in line][:3]
        print(name, "PASS" if done.returncode == 0 else "FAIL", " | ".join(why)[:300], flush=True)


if __name__ == "__main__":
    main()
