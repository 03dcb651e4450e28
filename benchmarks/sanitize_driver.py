"""Tiny calls of every bwd_fwd kernel, for compute-sanitizer (run by benchmarks/sanitize.sh).

Covers both implementations, the gate on and off, a partial last chunk (S % C != 0), several P
tiles (one partial) and several sequence segments (production with an explicit ScanConfig), a rank
that is not a power of two, grouped q/k heads, two query ranks per output step, and fp32 / bf16
activations (different dot dtypes, so different compiled kernels).  Each call is checked against
the other implementation, so a run that silently computes nothing fails too.

    python benchmarks/sanitize_driver.py [--list] [NAME_SUBSTRING]
"""

import dataclasses
import sys

import torch

from mamba3_mimo.api import bwd_fwd
from mamba3_mimo.inputs import make_inputs
from mamba3_mimo.ops.production import ScanConfig

NAMES = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
F32, BF16 = torch.float32, torch.bfloat16
# P = 40: tiles of 16, 16 and 8; N = 64: two N/2 tiles of 16; 5 chunks in 3 segments and groups of 2.
SEGMENTS = ScanConfig(block_p=16, n_segments=3, block_half=16, out_block_p=16, chunks_per_program=2)
# Two query ranks per output step (C = 8: 16 query rows of 8 tokens x 2 ranks), R = 3 leaves one rank alone.
RANK_PAIRS = ScanConfig(block_p=32, n_segments=2, out_block_p=32, ranks_per_step=2)
# Chunks read in spans of 2 and 4 (7 chunks of 8 with a tail: partial spans, segments of whole spans).
SPANS = ScanConfig(block_p=32, n_segments=3, out_block_p=32, out_span_chunks=2, end_span_chunks=2)
WIDE_SPANS = ScanConfig(block_p=16, n_segments=2, out_block_p=32, out_span_chunks=4, end_span_chunks=4)
# The P >= 128 launch of the dispatcher: one 4-warp output program over 128 columns (P = 96: a partial tile).
WIDE_P = ScanConfig(block_p=32, n_segments=2, out_block_p=128, out_num_warps=4)
# One scan pass writing segment-local states, the segment fold, the output stage adding the entry states
# (7 chunks in 3 segments, output spans of 2 straddling a segment boundary; 5 chunks in 3 segments).
LOCAL = ScanConfig(block_p=32, n_segments=3, out_block_p=32, out_span_chunks=2, local_states=True)
LOCAL_TILES = ScanConfig(block_p=16, n_segments=3, block_half=16, out_block_p=16, local_states=True)
# The split output stage (chunk_scan + gate_grads) with local states: 64-wide N/2 tiles with a partial second P
# tile (P = 96; a 32-wide P tile at N/2 = 64 miscompiled, wrong values here and an illegal address at full
# size, so chunk_scan refuses it), spans of 2 chunks of 8 with a 128-wide P tile, the dispatcher's register cap.
SPLIT_P_TILES = ScanConfig(block_p=32, n_segments=3, block_half=64, out_block_p=64, out_num_warps=4,
                           local_states=True, split_gate=True)
SPLIT_SPANS = ScanConfig(block_p=64, n_segments=2, block_half=64, out_block_p=128, out_num_warps=4, out_span_chunks=2,
                         local_states=True, split_gate=True)
SPLIT_CAPPED = ScanConfig(block_p=64, n_segments=3, block_half=64, out_block_p=64, out_num_warps=4, local_states=True,
                          split_gate=True, out_max_registers=168)
# The dispatcher's state-scan tiles at P = 128 (sweep of a0ddfb0): [2 x 32, 64] at N = 64 with local states,
# loading a step ahead, and at N = 128 with two passes (a 32-wide N/2 tile, two N/2 tiles and two P tiles), spans
# of 2 chunks of 8.
SPLIT_SCAN_N64 = ScanConfig(block_p=64, n_segments=3, block_half=32, out_block_p=128, out_num_warps=4,
                            local_states=True, split_gate=True, out_max_registers=168, scan_prefetch=True)
SPLIT_SCAN_N128 = ScanConfig(block_p=64, n_segments=3, block_half=32, out_block_p=128, out_num_warps=4,
                             out_span_chunks=2, end_span_chunks=2, split_gate=True, out_max_registers=168)
# The two-pass scans of N256's [2 x 64, 64] tiles at 8 warps (the dispatcher's since f57a6ee), here at N = 128.
SPLIT_SCAN_8_WARPS = ScanConfig(block_p=64, n_segments=3, block_half=64, num_warps=8, out_block_p=64, out_num_warps=4,
                                out_span_chunks=2, end_span_chunks=2, split_gate=True)
# Its end-state pass alone loading a step ahead (end_scan_prefetch: segments of two spans of 2 chunks).
SPLIT_SCAN_END_PREFETCH = dataclasses.replace(SPLIT_SCAN_8_WARPS, end_scan_prefetch=True)
# chunk_scan applying the gate itself (gate_in_scan, the dispatcher's choice without Z and at R = 1): a partial
# second P tile with Z, spans of 2 chunks of 8 over a 128-wide P tile without Z, and R = 1 with Z.
SPLIT_GATE_IN_SCAN = dataclasses.replace(SPLIT_P_TILES, out_max_registers=168, gate_in_scan=True)
SPLIT_GATE_IN_SCAN_SPANS = dataclasses.replace(SPLIT_SPANS, out_max_registers=168, gate_in_scan=True)
# q / k rotated in bf16 in both stages (bf16 tables), the D skip in gate_grads.
SPLIT_HALF_ROTATION = dataclasses.replace(SPLIT_P_TILES, scan_half_rotation=True, out_half_rotation=True,
                                          d_in_gate=True)
# gate_grads as the Gluon kernel (TMA boxes past S zero-filled, the dz store masked): R = 4 over a partial last token
# range, R = 8 with two ranks a thread.
SPLIT_GLUON_GATE = dataclasses.replace(SPLIT_HALF_ROTATION, gluon_gate=True)
# The storing scan forming raw_y and qk_dot (scan_outputs, with the Gluon scans and the angles): two 32-wide P tiles,
# two segments (the end-state pass's states folded in); then one 64-wide tile, q rotated in place (section 52).
SPLIT_SCAN_OUTPUTS = dataclasses.replace(SPLIT_GLUON_GATE, block_p=64, gluon_scan=True, angles_in_kernels=True,
                                         scan_outputs=True, scan_outputs_block_p=32)
SPLIT_SCAN_OUTPUTS_64 = dataclasses.replace(SPLIT_SCAN_OUTPUTS, scan_outputs_block_p=64)
SPLIT_SCAN_OUTPUTS_RING = dataclasses.replace(SPLIT_SCAN_OUTPUTS_64, scan_outputs_ring_weights=True)
# The gate in the fused pass (dz's rank sum through k~'s operands, the segments' partials), with and without Z.
SPLIT_SCAN_OUTPUTS_GATE = dataclasses.replace(SPLIT_SCAN_OUTPUTS_64, scan_outputs_gate=True)
# At N = 64 (both halves stacked): the widest tile (128 at P = 128) with the D skip added to raw_y.
SPLIT_SCAN_OUTPUTS_D_SKIP = dataclasses.replace(SPLIT_SCAN_OUTPUTS, scan_outputs_block_p=0, scan_outputs_d_skip=True)

# (name, impl, config, make_inputs keywords)
CASES = [
    ("production-default-z", "production", None,
     dict(B=1, S=40, H=2, G=1, N=32, P=32, R=2, chunk_size=16, dtype=F32, z=True, d=True)),
    ("production-default-noz", "production", None,
     dict(B=1, S=40, H=2, G=1, N=32, P=32, R=2, chunk_size=16, dtype=BF16, z=False, d=False)),
    ("production-segments-z", "production", SEGMENTS,
     dict(B=2, S=70, H=4, G=2, N=64, P=40, R=3, chunk_size=16, dtype=F32, z=True, d=True)),
    ("production-segments-noz", "production", SEGMENTS,
     dict(B=1, S=70, H=2, G=1, N=32, P=40, R=2, chunk_size=16, dtype=BF16, z=False, d=True)),
    ("production-rankpairs-z", "production", RANK_PAIRS,
     dict(B=1, S=44, H=2, G=1, N=64, P=32, R=3, chunk_size=8, dtype=BF16, z=True, d=True)),
    ("production-rankpairs-f32", "production", RANK_PAIRS,
     dict(B=1, S=40, H=2, G=2, N=64, P=32, R=4, chunk_size=8, dtype=F32, z=True, d=True)),
    ("production-spans-z", "production", SPANS,
     dict(B=1, S=53, H=2, G=1, N=64, P=32, R=4, chunk_size=8, dtype=BF16, z=True, d=True)),
    ("production-widespans-f32", "production", WIDE_SPANS,
     dict(B=1, S=53, H=2, G=1, N=32, P=40, R=2, chunk_size=8, dtype=F32, z=True, d=True)),
    ("production-widep-z", "production", WIDE_P,
     dict(B=1, S=40, H=2, G=1, N=64, P=96, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-local-z", "production", LOCAL,
     dict(B=1, S=53, H=2, G=1, N=64, P=32, R=4, chunk_size=8, dtype=BF16, z=True, d=True)),
    ("production-local-f32", "production", LOCAL_TILES,
     dict(B=2, S=70, H=2, G=1, N=64, P=40, R=2, chunk_size=16, dtype=F32, z=True, d=True)),
    ("production-split-ptiles", "production", SPLIT_P_TILES,
     dict(B=1, S=80, H=2, G=1, N=128, P=96, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-spans", "production", SPLIT_SPANS,
     dict(B=1, S=72, H=2, G=1, N=128, P=128, R=4, chunk_size=8, dtype=BF16, z=True, d=True)),
    ("production-split-capped", "production", SPLIT_CAPPED,
     dict(B=1, S=100, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=F32, z=False, d=True)),
    ("production-split-scan-n64", "production", SPLIT_SCAN_N64,
     dict(B=1, S=96, H=2, G=1, N=64, P=128, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-scan-n128", "production", SPLIT_SCAN_N128,
     dict(B=1, S=72, H=2, G=1, N=128, P=128, R=4, chunk_size=8, dtype=BF16, z=True, d=True)),
    ("production-split-scan-8-warps", "production", SPLIT_SCAN_8_WARPS,
     dict(B=1, S=72, H=2, G=1, N=128, P=64, R=4, chunk_size=8, dtype=BF16, z=True, d=True)),
    ("production-split-scan-end-prefetch", "production", SPLIT_SCAN_END_PREFETCH,
     dict(B=1, S=72, H=2, G=1, N=128, P=64, R=4, chunk_size=8, dtype=BF16, z=True, d=True)),
    ("production-split-gate-in-scan-z", "production", SPLIT_GATE_IN_SCAN,
     dict(B=1, S=80, H=2, G=1, N=128, P=96, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-gate-in-scan-noz", "production", SPLIT_GATE_IN_SCAN_SPANS,
     dict(B=1, S=72, H=2, G=1, N=128, P=128, R=4, chunk_size=8, dtype=BF16, z=False, d=True)),
    ("production-split-gate-in-scan-r1", "production", SPLIT_GATE_IN_SCAN,
     dict(B=1, S=150, H=2, G=1, N=128, P=64, R=1, chunk_size=64, dtype=F32, z=True, d=True)),
    ("production-split-half-rotation", "production", SPLIT_HALF_ROTATION,
     dict(B=1, S=80, H=2, G=1, N=128, P=96, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-gluon-gate-r4", "production", SPLIT_GLUON_GATE,
     dict(B=1, S=100, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-gluon-gate-r8", "production", SPLIT_GLUON_GATE,
     dict(B=1, S=72, H=2, G=1, N=128, P=64, R=8, chunk_size=8, dtype=BF16, z=True, d=True)),
    ("production-split-scan-outputs", "production", SPLIT_SCAN_OUTPUTS,
     dict(B=1, S=128, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-scan-outputs-64", "production", SPLIT_SCAN_OUTPUTS_64,
     dict(B=1, S=128, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-scan-outputs-ring", "production", SPLIT_SCAN_OUTPUTS_RING,
     dict(B=1, S=128, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-scan-outputs-gate", "production", SPLIT_SCAN_OUTPUTS_GATE,
     dict(B=1, S=128, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-scan-outputs-gate-noz", "production", SPLIT_SCAN_OUTPUTS_GATE,
     dict(B=1, S=128, H=2, G=1, N=128, P=64, R=8, chunk_size=8, dtype=BF16, z=False, d=True)),
    ("production-split-scan-outputs-n64-d-skip", "production", SPLIT_SCAN_OUTPUTS_D_SKIP,
     dict(B=1, S=128, H=2, G=1, N=64, P=128, R=4, chunk_size=16, dtype=BF16, z=True, d=True)),
    ("production-split-scan-outputs-n64-gate-noz", "production", SPLIT_SCAN_OUTPUTS_GATE,
     dict(B=1, S=128, H=2, G=1, N=64, P=64, R=4, chunk_size=16, dtype=BF16, z=False, d=True)),
    ("stage0-z", "stage0", None,
     dict(B=2, S=40, H=4, G=2, N=16, P=40, R=3, chunk_size=16, dtype=F32, z=True, d=True)),
    ("stage0-noz", "stage0", None,
     dict(B=1, S=40, H=2, G=1, N=32, P=32, R=2, chunk_size=16, dtype=BF16, z=False, d=False)),
]
OTHER = {"production": "stage0", "stage0": "production"}


def main(argv):
    if "--list" in argv:
        for name, impl, config, shape in CASES:
            print(name, impl, config, shape)
        return 0
    if not torch.cuda.is_available():
        print("sanitize_driver: needs a CUDA device", file=sys.stderr)
        return 2
    only = [a for a in argv if not a.startswith("--")]
    cases = [c for c in CASES if not only or any(o in c[0] for o in only)]
    failed = 0
    for i, (name, impl, config, shape) in enumerate(CASES):
        if (name, impl, config, shape) not in cases:
            continue
        # A first call on other inputs records the production call; the one compared below is then replayed
        # (ops/launch.py) unless MAMBA3_MIMO_CHECK_PLAN=1, so the sanitizer sees the replayed launches too.
        bwd_fwd(**make_inputs(**shape, device="cuda", seed=2000 + i), impl=impl, config=config)
        inputs = make_inputs(**shape, device="cuda", seed=1000 + i)
        out = bwd_fwd(**inputs, impl=impl, config=config)
        other = bwd_fwd(**inputs, impl=OTHER[impl])
        torch.cuda.synchronize()
        tol = 1e-4 if shape["dtype"] == F32 else 3e-2
        bad = []
        for out_name, x, y in zip(NAMES, out, other):
            if (x is None) != (y is None):
                bad.append(f"{out_name}: None mismatch")
            elif x is not None:
                scale = y.abs().max().item() or 1.0
                err = (x - y).abs().max().item() / scale
                if not err <= tol:
                    bad.append(f"{out_name}: max rel diff {err:.2e}")
        failed += bool(bad)
        print(f"{name:26s} {'ok' if not bad else 'MISMATCH ' + '; '.join(bad)}", flush=True)
    print(f"sanitize_driver: {len(cases) - failed}/{len(cases)} cases agree between implementations")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
