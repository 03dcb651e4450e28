"""Both Triton implementations against the float64 reference (SPEC sections 4, 7 and 8).

The small cases run on the test device: the GPU where there is one, else the CPU through the
Triton interpreter. The ``gpu`` cases (SPEC section 8 grids) need CUDA and are skipped without it.
Every run poisons the outputs first (see ``check_kernel`` in conftest.py).
"""

import dataclasses
import itertools
import os

import pytest
import torch
import triton.language as tl

import mamba3_mimo.api as api
from conftest import HAS_CUDA, requires_cuda, seed_for, spy_gate_grads
from mamba3_mimo.accuracy import mere_mare
from mamba3_mimo.inputs import build_discretization, make_inputs
from mamba3_mimo.ops import group_sum, production
from mamba3_mimo.ops.chunk_scan import refuse_miscompiled_tile, chunk_scan_meta
from mamba3_mimo.ops.production import ScanConfig
from mamba3_mimo.reference import bwd_fwd_reference

IMPLS = ("production", "stage0")
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPE_NAMES = {F16: "fp16", BF16: "bf16", F32: "fp32"}


def covering_array(factors, cost=lambda row: 0):
    """Rows (dicts) in which every pair of values of every two factors occurs at least once.

    Greedy and deterministic: each step takes the candidate of the full product that covers the
    most uncovered pairs, the cheapest of those.
    """
    names = list(factors)

    def pairs(row):
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}

    candidates = [dict(zip(names, values)) for values in itertools.product(*factors.values())]
    uncovered = set().union(*(pairs(row) for row in candidates))
    rows = []
    while uncovered:
        best = max(candidates, key=lambda row: (len(pairs(row) & uncovered), -cost(row)))
        rows.append(best)
        uncovered -= pairs(best)
    return rows


def group_count(symbol, H):
    return {"1": 1, "H/2": max(1, H // 2), "H": H}[symbol]


def row_id(row):
    return "-".join(f"{k}{DTYPE_NAMES.get(v, v)}" for k, v in row.items())


# --- small cases, any device ----------------------------------------------------------------------

SMALL_FACTORS = dict(dtype=(F16, BF16, F32), out=(F32, BF16, F16), Z=(True, False), D=(True, False),
                     G=("1", "H"), B=(1, 2), S=(32, 64), H=(2, 4))
# The interpreter's time grows with B * S * H: prefer the small ones among equally good rows.
SMALL_ROWS = covering_array(SMALL_FACTORS, cost=lambda r: r["B"] * r["S"] * r["H"])


def test_covering_arrays_cover_every_pair():
    for factors, rows in ((SMALL_FACTORS, SMALL_ROWS), (GPU_FACTORS, GPU_ROWS)):
        for a, b in itertools.combinations(factors, 2):
            seen = {(row[a], row[b]) for row in rows}
            assert seen == set(itertools.product(factors[a], factors[b])), (a, b)
    assert len(SMALL_ROWS) <= 12 and len(GPU_ROWS) <= 12


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("index,row", list(enumerate(SMALL_ROWS)), ids=[row_id(r) for r in SMALL_ROWS])
def test_pairwise_small(check_kernel, impl, index, row):
    # N and P, outside the covering array, take their two levels in turn.  P stays >= 32: the
    # dual benchmark averages over the B*H*R*P entries of dmimo_o, and with ~100 entries one
    # near-zero entry decides MERE/MARE by luck (seen: fp32, B1 H4 P16, bench exact on it).
    N, P = (16, 32)[index % 2], (32, 48)[index // 2 % 2]
    check_kernel(impl, B=row["B"], S=row["S"], H=row["H"], G=group_count(row["G"], row["H"]), N=N, P=P, R=2,
                 chunk_size=16, dtype=row["dtype"], z=row["Z"], d=row["D"], output_dtype=row["out"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("S,C", [(33, 16), (40, 16), (33, 32), (40, 32)])
def test_tail(check_kernel, impl, S, C):
    check_kernel(impl, B=1, S=S, H=2, G=1, N=16, P=16, R=2, chunk_size=C, dtype=F32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_rank(check_kernel, impl, R):
    check_kernel(impl, B=1, S=32, H=2, G=2, N=16, P=16, R=R, chunk_size=16, dtype=F32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("divisor", [2, 4])
def test_rotary_dim_divisor(check_kernel, impl, divisor):
    # H * R * P = 256 dmimo_o elements: with 64 one near-zero element decided the dual-benchmark mean
    # (docs/practice.md, "MERE on small outputs").
    check_kernel(impl, B=1, S=32, H=4, N=32, P=32, R=2, chunk_size=16, dtype=F32, rotary_dim_divisor=divisor)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("N,P", [(48, 16), (16, 48)])
def test_non_power_of_two_dims(check_kernel, impl, N, P):
    check_kernel(impl, B=1, S=32, H=2, N=N, P=P, R=2, chunk_size=16, dtype=F32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("C", [8, 12])
def test_non_power_of_two_chunk(check_kernel, impl, C):
    check_kernel(impl, B=1, S=40, H=2, N=16, P=16, R=2, chunk_size=C, dtype=F32)


@pytest.mark.parametrize("C,R,inner", [(16, 4, 16), (8, 8, 8), (64, 1, 64), (32, 4, 16), (64, 4, 16), (16, 8, 8),
                                         (32, 3, 16), (48, 2, 24), (16, 6, 8), (67, 1, 1)])
def test_inner_chunk_size(C, R, inner):
    """The largest divisor of C whose (token, rank) rows, next_pow2(C) * next_pow2(R), fit MAX_KERNEL_ROWS."""
    assert production.MAX_KERNEL_ROWS == 64
    assert production.inner_chunk_size(C, R) == inner


def test_dispatcher_sizes_the_inner_chunk():
    """choose_config for a chunk over 64 rows is the config of the chunk the kernels walk."""
    sizes = dict(B=4, H=16, S=2048, N=256, P=64, num_sms=132)
    assert production.choose_config(**sizes, R=4, chunk_size=64) == production.choose_config(**sizes, R=4,
                                                                                             chunk_size=16)
    assert production.choose_config(**sizes, R=8, chunk_size=16) == production.choose_config(**sizes, R=8,
                                                                                             chunk_size=8)


@pytest.mark.parametrize("S", [50, 64, 72])
@pytest.mark.parametrize("C,inner", [(32, 16), (48, 24), (64, 8)])
def test_inner_chunk_decays_are_those_of_the_inner_chunks(S, C, inner):
    """da_cs / da_cs_rev of C-token chunks turned into those of inner chunks equal the ones built for inner chunks
    from the per-token decays (tail chunks included)."""
    dA = -torch.rand(2, 3, S, dtype=torch.float64, generator=torch.Generator().manual_seed(seed_for(S, C)))
    da_cs, da_cs_rev, _ = build_discretization(dA, C)
    want_cs, want_rev, _ = build_discretization(dA, inner)
    got_cs, got_rev = production.inner_chunk_decays(da_cs=da_cs, da_cs_rev=da_cs_rev, chunk_size=C, inner_chunk=inner)
    torch.testing.assert_close(got_cs, want_cs, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_rev, want_rev, rtol=0, atol=1e-12)


# Chunks of more (token, rank) rows than the kernels take are walked as inner chunks (production.inner_chunk_size):
# 32 x 4 rows with a tail chunk, R = 3 (padded to 4 rank rows) without Z, and C = 48 (inner chunks of 24).
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S,R,C,z", [(50, 4, 32, True), (72, 3, 32, False), (40, 2, 48, True)])
def test_production_inner_chunks(check_kernel, S, R, C, z, dtype):
    assert production.inner_chunk_size(C, R) < C
    check_kernel("production", B=1, S=S, H=2, N=16, P=16, R=R, chunk_size=C, z=z, dtype=dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("S", [1, 10])
def test_sequence_shorter_than_chunk(check_kernel, impl, S):
    check_kernel(impl, B=1, S=S, H=2, N=16, P=16, R=2, chunk_size=16, dtype=F32)


@pytest.mark.parametrize("impl", IMPLS)
def test_half_output_of_fp32_inputs(check_kernel, impl):
    check_kernel(impl, B=1, S=40, H=2, N=16, P=16, R=2, chunk_size=16, dtype=F32, output_dtype=BF16)


@pytest.mark.parametrize("impl", IMPLS)
def test_parameters_in_other_float_dtypes(check_kernel, impl):
    """Parameters and discretization tensors of any float dtype are upcast (SPEC section 2)."""
    def recast(inputs):
        out = dict(inputs)
        for name, dtype in dict(q_bias=torch.float64, mimo_v=BF16, mimo_z=F16, d=torch.float64,
                                da_cs=torch.float64, dt=torch.float64, angles=torch.float64).items():
            out[name] = inputs[name].to(dtype)
        return out

    check_kernel(impl, B=1, S=32, H=2, N=16, P=16, R=2, chunk_size=16, dtype=F32, transform=recast)


# 5 chunks: 2 and 3 segments do not divide them, 8 is more segments than chunks; N/2 = 32 in tiles
# of 16; P = 48 in tiles of 16 or 32 (one partial); chunk groups of 2, 3, 4 and 8 (partial groups).
PRODUCTION_CONFIGS = [
    ScanConfig(block_p=16, n_segments=1),
    ScanConfig(block_p=16, n_segments=2, block_half=16, out_block_p=16, chunks_per_program=2),
    ScanConfig(block_p=32, n_segments=3, block_half=16, out_block_p=32, chunks_per_program=3),
    ScanConfig(block_p=16, n_segments=5, out_block_p=16, chunks_per_program=4, num_warps=2, out_num_warps=4),
    ScanConfig(block_p=32, n_segments=8, block_half=32, out_block_p=64, chunks_per_program=8),
    ScanConfig(block_p=32, n_segments=3, block_half=32, out_block_p=32, scan_max_registers=168),  # a capped scan
    # Scans that load a step ahead: two passes (the end-state pass in spans of 2; then that pass alone, a chunk a
    # step), then local states with two chunks a step, each segment's last step loading nothing.
    ScanConfig(block_p=32, n_segments=2, block_half=16, out_block_p=32, end_span_chunks=2, scan_prefetch=True),
    ScanConfig(block_p=32, n_segments=2, block_half=16, out_block_p=32, end_scan_prefetch=True),
    ScanConfig(block_p=16, n_segments=2, out_block_p=16, local_states=True, split_gate=True, state_span_chunks=2,
               scan_prefetch=True),
    # Scans whose upper N/2 tile (n >= RD = 16 of 32) skips the rotation: two passes, then local states loading
    # a step ahead.
    ScanConfig(block_p=32, n_segments=3, block_half=16, out_block_p=32, scan_skip_unrotated=True),
    ScanConfig(block_p=16, n_segments=2, block_half=16, out_block_p=16, local_states=True, split_gate=True,
               scan_prefetch=True, scan_skip_unrotated=True, flat_tables=True),
    # Local states folded by one scan over the segments: three of them (a partial tile of four), and one per chunk.
    ScanConfig(block_p=32, n_segments=3, block_half=16, out_block_p=32, local_states=True, split_gate=True,
               fold_one_scan=True),
    ScanConfig(block_p=16, n_segments=8, out_block_p=16, local_states=True, fold_one_scan=True),
    # The narrow N/2 tile over a 64-wide P tile (the dispatcher's N <= 32 rule, section 42): a partial P tile, two
    # chunks a storing step, more segments than chunks.
    ScanConfig(block_p=64, n_segments=8, block_half=16, out_block_p=64, local_states=True, split_gate=True,
               state_span_chunks=2, scan_max_registers=128, fold_one_scan=True),
    # chunk_scan over single 32-row chunks at 2 warps and 96 registers, applying the gate (Z on), beside a storing
    # scan of two chunks a step, in the bf16 rotation's low-register order (the dispatcher's N16 rule,
    # SMALL_CHUNK_SCAN, section 43).
    ScanConfig(block_p=64, n_segments=3, block_half=16, out_block_p=64, local_states=True, split_gate=True,
               state_span_chunks=2, out_span_chunks=1, out_num_warps=2, out_max_registers=96, fold_one_scan=True,
               gate_in_scan=True, scan_half_rotation=True, out_half_rotation=True, out_q_cast_early=True,
               out_y_state_early=True),
    # chunk_scan writing the fixed-up entering state after q~ @ state and qk_dot after the products
    # (out_defer_state_store, out_defer_qk_dot, section 44): the low-register order with raw_y stored and both; the
    # gate in chunk_scan over spans of two chunks (the second chunk's state is still written where it is loaded) in
    # the default order; qk_dot alone in two passes.
    ScanConfig(block_p=32, n_segments=3, block_half=16, out_block_p=32, local_states=True, split_gate=True,
               fold_one_scan=True, out_defer_state_store=True, out_defer_qk_dot=True, scan_half_rotation=True,
               out_half_rotation=True, out_q_cast_early=True, out_y_state_early=True),
    ScanConfig(block_p=16, n_segments=2, out_block_p=32, local_states=True, split_gate=True, gate_in_scan=True,
               out_span_chunks=2, out_defer_state_store=True),
    ScanConfig(block_p=32, n_segments=2, block_half=16, out_block_p=32, split_gate=True, out_defer_qk_dot=True),
    # qk_dot deferred in the gated chunk_scan over two passes: N128_P128 without Z (sweep_prepared.sh part 29 timed it
    # 579 -> 562 us; section 45).
    ScanConfig(block_p=32, n_segments=2, block_half=16, out_block_p=32, split_gate=True, gate_in_scan=True,
               out_defer_qk_dot=True),
]


@pytest.mark.parametrize("config", PRODUCTION_CONFIGS, ids=lambda c: f"p{c.block_p}-s{c.n_segments}-n{c.block_half}-"
                         f"o{c.out_block_p}-g{c.chunks_per_program}" + ("-pf" if c.scan_prefetch else "")
                         + ("-epf" if c.end_scan_prefetch else "")
                         + ("-skip" if c.scan_skip_unrotated else "") + ("-flat" if c.flat_tables else "")
                         + ("-local" if c.local_states else "") + ("-fold1" if c.fold_one_scan else "")
                         + ("-defer" if c.out_defer_state_store else "") + ("-dqk" if c.out_defer_qk_dot else "")
                         + ("-gs" if c.gate_in_scan else ""))
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_production_configs(check_kernel, config, dtype):
    """Every explicit config is exact: segments, N/2 and P tiles, chunk groups of the output stage."""
    check_kernel("production", B=1, S=70, H=2, N=64, P=48, R=2, chunk_size=16, dtype=dtype, config=config)


@pytest.mark.parametrize("gate_in_scan", [False, True], ids=["split", "gate-in-scan"])
def test_production_wide_group_sum(check_kernel, monkeypatch, gate_in_scan):
    """group_sum's wide tile (``group_sum.WIDE_TILE``, taken at N16 with Z on the GPU for its 256 chunk partials) in
    the production path, with the threshold lowered so a small call takes it."""
    monkeypatch.setattr(group_sum, "WIDE_GROUPS", 2)
    tiles = []
    plain = group_sum.partials_tile

    def spy(n_groups, has_z):
        tiles.append(plain(n_groups, has_z))
        return tiles[-1]

    monkeypatch.setattr(group_sum, "partials_tile", spy)
    monkeypatch.setenv("MAMBA3_MIMO_JIT_LAUNCH", "1")  # no call replay: every call goes through the spy
    config = ScanConfig(block_p=16, n_segments=2, out_block_p=32, split_gate=True, gate_in_scan=gate_in_scan,
                        gate_tokens=16)
    check_kernel("production", B=1, S=70, H=2, N=32, P=32, R=2, chunk_size=8, dtype=F32, config=config)
    assert tiles and all(tile == group_sum.WIDE_TILE for tile in tiles)


# Several query ranks per output step: R not divisible by the step (3 by 2), a step wider than R
# (4 > 3), C = 8 and 4 (the shapes the step is for), a tail chunk (S = 45), GQA and no Z.
RANK_STEP_CASES = [
    dict(R=3, chunk_size=8, ranks_per_step=2, S=45, z=True),
    dict(R=4, chunk_size=8, ranks_per_step=2, S=48, z=True),
    dict(R=3, chunk_size=4, ranks_per_step=4, S=30, z=False),
    dict(R=8, chunk_size=8, ranks_per_step=4, S=40, z=True),
]


@pytest.mark.parametrize("case", RANK_STEP_CASES, ids=lambda c: f"R{c['R']}-C{c['chunk_size']}-f{c['ranks_per_step']}")
@pytest.mark.parametrize("dtype", [F32, F16])
def test_production_ranks_per_step(check_kernel, case, dtype):
    """The output stage's multi-rank query tiles are exact against the float64 reference."""
    config = ScanConfig(block_p=16, n_segments=2, out_block_p=32, ranks_per_step=case["ranks_per_step"])
    check_kernel("production", B=1, S=case["S"], H=2, G=1 if case["R"] == 8 else 2, N=32, P=32, R=case["R"],
                 chunk_size=case["chunk_size"], dtype=dtype, z=case["z"], config=config)

# Spans of chunks read as one (output stage and segment end states): spans that do not divide the
# chunks (7 chunks of 8 in spans of 2 and 4; a tail chunk at S = 53), a span longer than the sequence,
# spans with several segments (chunks_per_segment rounded up to whole spans), several ranks per step.
SPAN_CASES = [
    dict(S=53, chunk_size=8, out_span=2, end_span=2, n_segments=3, ranks_per_step=1, z=True),
    dict(S=56, chunk_size=8, out_span=4, end_span=4, n_segments=2, ranks_per_step=1, z=True),
    dict(S=37, chunk_size=4, out_span=4, end_span=2, n_segments=4, ranks_per_step=2, z=False),
    dict(S=20, chunk_size=8, out_span=4, end_span=1, n_segments=1, ranks_per_step=1, z=True),
]


@pytest.mark.parametrize("case", SPAN_CASES, ids=lambda c: f"S{c['S']}-C{c['chunk_size']}-o{c['out_span']}-"
                         f"e{c['end_span']}-s{c['n_segments']}")
@pytest.mark.parametrize("dtype", [F32, F16])
def test_production_spans(check_kernel, case, dtype):
    """Chunks taken in spans give the outputs of one chunk at a time (states are still per chunk)."""
    config = ScanConfig(block_p=16, n_segments=case["n_segments"], out_block_p=32,
                        ranks_per_step=case["ranks_per_step"], out_span_chunks=case["out_span"],
                        end_span_chunks=case["end_span"])
    check_kernel("production", B=1, S=case["S"], H=2, G=1, N=32, P=32, R=2, chunk_size=case["chunk_size"],
                 dtype=dtype, z=case["z"], config=config)


# The storing scan taking several chunks a step (state_span_chunks): two passes and local states, segments
# that do not divide the chunks, a span longer than the sequence (chunks past nch masked), tails, a span
# of the end-state scan that differs from it (segments hold whole steps of both), the split output stage.
STATE_SPAN_CASES = [
    dict(S=53, chunk_size=8, state_span=2, end_span=2, n_segments=3, local=False, split=False),
    dict(S=70, chunk_size=16, state_span=2, end_span=1, n_segments=2, local=False, split=True),
    dict(S=45, chunk_size=4, state_span=4, end_span=2, n_segments=2, local=False, split=False),
    dict(S=53, chunk_size=8, state_span=2, end_span=1, n_segments=3, local=True, split=True),
    dict(S=37, chunk_size=4, state_span=4, end_span=1, n_segments=2, local=True, split=False),
    dict(S=20, chunk_size=8, state_span=4, end_span=1, n_segments=1, local=False, split=True),
]


@pytest.mark.parametrize("case", STATE_SPAN_CASES, ids=lambda c: f"S{c['S']}-C{c['chunk_size']}-st{c['state_span']}-"
                         f"e{c['end_span']}-s{c['n_segments']}-{'local' if c['local'] else 'two'}")
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_production_state_spans(check_kernel, case, dtype):
    """A storing scan that loads several chunks a step stores every chunk's entering state."""
    config = ScanConfig(block_p=16, n_segments=case["n_segments"], out_block_p=32, local_states=case["local"],
                        end_span_chunks=case["end_span"], state_span_chunks=case["state_span"],
                        split_gate=case["split"])
    check_kernel("production", B=1, S=case["S"], H=2, G=1, N=32, P=32, R=2, chunk_size=case["chunk_size"],
                 dtype=dtype, z=True, config=config)


# One scan pass writing segment-local states, the segment fold, and the output stage adding each
# chunk's decayed entry state: segments that do not divide the chunks (5 chunks in 3 segments, 7 in
# 3, 5 in 2), more segments than chunks, output spans that straddle segment boundaries, tails,
# chunk groups, several ranks per step, no Z.
LOCAL_STATE_CASES = [
    dict(S=70, chunk_size=16, n_segments=3, out_span=1, chunks_per_program=1, ranks_per_step=1, z=True),
    dict(S=70, chunk_size=16, n_segments=8, out_span=1, chunks_per_program=2, ranks_per_step=1, z=True),
    dict(S=53, chunk_size=8, n_segments=3, out_span=2, chunks_per_program=1, ranks_per_step=1, z=True),
    dict(S=64, chunk_size=8, n_segments=2, out_span=4, chunks_per_program=2, ranks_per_step=1, z=False),
    dict(S=37, chunk_size=8, n_segments=2, out_span=2, chunks_per_program=1, ranks_per_step=2, z=True),
]


@pytest.mark.parametrize("case", LOCAL_STATE_CASES, ids=lambda c: f"S{c['S']}-C{c['chunk_size']}-s{c['n_segments']}-"
                         f"o{c['out_span']}-g{c['chunks_per_program']}")
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_production_local_states(check_kernel, case, dtype):
    """Segment-local states plus the entry fold give the states and outputs of the two-pass scan."""
    config = ScanConfig(block_p=16, n_segments=case["n_segments"], out_block_p=32, local_states=True,
                        out_span_chunks=case["out_span"], chunks_per_program=case["chunks_per_program"],
                        ranks_per_step=case["ranks_per_step"])
    check_kernel("production", B=2, S=case["S"], H=2, G=1, N=32, P=32, R=2, chunk_size=case["chunk_size"],
                 dtype=dtype, z=case["z"], config=config)


# The split output stage (chunk_scan stores raw_y of all ranks, gate_grads streams over tokens): ranks
# that are not a power of two (padded rank rows), spans of chunks, tails, local states with segments
# that do not divide the chunks, GQA, N = 16 (one 16-wide N/2 tile), P tiles, no Z.
SPLIT_GATE_CASES = [
    dict(S=70, chunk_size=16, R=2, G=1, N=32, P=32, n_segments=3, out_span=1, local=True, out_block_p=32, z=True),
    dict(S=45, chunk_size=8, R=3, G=2, N=32, P=48, n_segments=2, out_span=2, local=False, out_block_p=16, z=True),
    dict(S=37, chunk_size=4, R=4, G=1, N=16, P=16, n_segments=2, out_span=4, local=False, out_block_p=16, z=False),
    dict(S=20, chunk_size=16, R=1, G=2, N=64, P=32, n_segments=1, out_span=1, local=False, out_block_p=32, z=True),
    dict(S=53, chunk_size=8, R=6, G=1, N=32, P=32, n_segments=3, out_span=2, local=True, out_block_p=32, z=True),
    # chunk_scan programs walking several spans: a last program with spans past the sequence, local states.
    dict(S=70, chunk_size=16, R=2, G=1, N=32, P=32, n_segments=3, out_span=1, local=True, out_block_p=32, z=True,
         spans_per_program=2),
    dict(S=45, chunk_size=8, R=3, G=2, N=32, P=48, n_segments=2, out_span=2, local=False, out_block_p=16, z=True,
         spans_per_program=4),
    # chunk_scan applying the gate itself (gate_in_scan): three P tiles and spans past the sequence, no Z,
    # padding ranks (R = 6 in 8) with local states, one rank.
    dict(S=45, chunk_size=8, R=3, G=2, N=32, P=48, n_segments=2, out_span=2, local=False, out_block_p=16, z=True,
         spans_per_program=4, gate_in_scan=True),
    # ... with local states, three spans a program and a last program with a span past the sequence (section 43).
    dict(S=70, chunk_size=16, R=2, G=1, N=32, P=32, n_segments=3, out_span=1, local=True, out_block_p=32, z=True,
         spans_per_program=3, gate_in_scan=True),
    dict(S=37, chunk_size=4, R=4, G=1, N=16, P=16, n_segments=2, out_span=4, local=False, out_block_p=16, z=False,
         gate_in_scan=True),
    dict(S=53, chunk_size=8, R=6, G=1, N=32, P=32, n_segments=3, out_span=2, local=True, out_block_p=32, z=True,
         gate_in_scan=True),
    dict(S=20, chunk_size=16, R=1, G=2, N=64, P=32, n_segments=1, out_span=1, local=False, out_block_p=32, z=True,
         gate_in_scan=True),
    # chunk_scan adding the D skip after its products (d_in_gate off; the cases above add it in the gate's math, in
    # gate_grads or in chunk_scan's gate epilogue): local states and padding ranks, two-pass with GQA, and the gate in
    # chunk_scan without Z and with it at one rank.
    dict(S=53, chunk_size=8, R=6, G=1, N=32, P=32, n_segments=3, out_span=2, local=True, out_block_p=32, z=True,
         d_in_gate=False),
    dict(S=45, chunk_size=8, R=3, G=2, N=32, P=48, n_segments=2, out_span=2, local=False, out_block_p=16, z=False,
         d_in_gate=False),
    dict(S=37, chunk_size=4, R=4, G=1, N=16, P=16, n_segments=2, out_span=4, local=False, out_block_p=16, z=False,
         gate_in_scan=True, d_in_gate=False),
    dict(S=20, chunk_size=16, R=1, G=2, N=64, P=32, n_segments=1, out_span=1, local=False, out_block_p=32, z=True,
         gate_in_scan=True, d_in_gate=False),
    # chunk_scan's products reordered for registers (q~ narrowed before k is loaded; q~ @ state right after the
    # scores): local states with padding ranks, the gate in chunk_scan on three P tiles without Z, and q~ narrowed
    # early alone on a two-pass GQA case with the D skip after the products.
    dict(S=53, chunk_size=8, R=6, G=1, N=32, P=32, n_segments=3, out_span=2, local=True, out_block_p=32, z=True,
         reorder="qy"),
    dict(S=45, chunk_size=8, R=3, G=2, N=32, P=48, n_segments=2, out_span=2, local=False, out_block_p=16, z=False,
         gate_in_scan=True, reorder="qy"),
    dict(S=45, chunk_size=8, R=3, G=2, N=32, P=48, n_segments=2, out_span=2, local=False, out_block_p=16, z=True,
         d_in_gate=False, reorder="q"),
]


@pytest.mark.parametrize("case", SPLIT_GATE_CASES, ids=lambda c: f"S{c['S']}-C{c['chunk_size']}-R{c['R']}-"
                         f"o{c['out_span']}-{'local' if c['local'] else 'two'}-g{c.get('spans_per_program', 1)}"
                         f"{'-gate_in_scan' if c.get('gate_in_scan') else ''}"
                         f"{'-d_in_chunk_scan' if not c.get('d_in_gate', True) else ''}"
                         f"{'-early_' + c['reorder'] if c.get('reorder') else ''}")
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_production_split_gate(check_kernel, case, dtype):
    """The split output stage (chunk_scan, then gate_grads or the gate in chunk_scan) is exact against float64."""
    config = ScanConfig(block_p=16, n_segments=case["n_segments"], out_block_p=case["out_block_p"],
                        local_states=case["local"], out_span_chunks=case["out_span"],
                        end_span_chunks=case["out_span"], split_gate=True,
                        chunks_per_program=case.get("spans_per_program", 1),
                        gate_in_scan=case.get("gate_in_scan", False), d_in_gate=case.get("d_in_gate", True),
                        out_q_cast_early="q" in case.get("reorder", ""),
                        out_y_state_early="y" in case.get("reorder", ""))
    check_kernel("production", B=2, S=case["S"], H=2, G=case["G"], N=case["N"], P=case["P"], R=case["R"],
                 chunk_size=case["chunk_size"], dtype=dtype, z=case["z"], config=config)


# q's and k's bias add and rotation in the products' 16-bit dtype (scan_half_rotation, out_half_rotation).  fp16
# activations take fp16 math, which the interpreter rounds per operation as the GPU does (bf16 takes fp32 products
# and so fp32 math there, bf16 on the GPU; fp32 activations keep fp32 math).  Two passes with the fused stage on two
# N/2 tiles (one past RD); local states loading ahead with the split stage; the gate in chunk_scan, local states and
# the unrotated tile's branch with only the scan in half (tables in their own dtype, converted); the fused stage's
# multi-rank query tiles with padding ranks and GQA, only the output stage in half.
HALF_ROTATION_CASES = [
    dict(R=2, G=1, config=ScanConfig(block_p=32, n_segments=3, block_half=16, out_block_p=32, scan_half_rotation=True,
                                     out_half_rotation=True)),
    dict(R=2, G=1, config=ScanConfig(block_p=16, n_segments=2, out_block_p=16, local_states=True, split_gate=True,
                                     state_span_chunks=2, scan_prefetch=True, scan_half_rotation=True,
                                     out_half_rotation=True)),
    dict(R=2, G=2, config=ScanConfig(block_p=16, n_segments=2, block_half=16, out_block_p=16, local_states=True,
                                     split_gate=True, gate_in_scan=True, scan_skip_unrotated=True,
                                     scan_half_rotation=True)),
    dict(R=3, G=1, config=ScanConfig(block_p=16, n_segments=2, out_block_p=32, ranks_per_step=2,
                                     out_half_rotation=True)),
    # chunk_scan's deferred stores in the half rotation (section 45): the entering state after q~ @ state with the
    # gate in chunk_scan, and qk_dot after the products at four ranks with raw_y stored (a 32-wide P tile: a 16-wide
    # one miscompiles at R = 4, N = 64 with or without it).
    dict(R=2, G=1, config=ScanConfig(block_p=32, n_segments=3, block_half=16, out_block_p=32, local_states=True,
                                     split_gate=True, gate_in_scan=True, fold_one_scan=True,
                                     out_defer_state_store=True, scan_half_rotation=True, out_half_rotation=True,
                                     out_q_cast_early=True, out_y_state_early=True)),
    dict(R=4, G=1, config=ScanConfig(block_p=16, n_segments=2, out_block_p=32, local_states=True, split_gate=True,
                                     out_defer_qk_dot=True, out_half_rotation=True)),
    # chunk_scan alone in half in the low-register order, two passes, spans of two chunks (the N = 256 rule, section
    # 46).
    dict(R=2, G=1, config=ScanConfig(block_p=32, n_segments=2, out_block_p=32, split_gate=True, out_span_chunks=2,
                                     end_span_chunks=2, out_half_rotation=True, out_q_cast_early=True,
                                     out_y_state_early=True)),
]


@pytest.mark.parametrize("case", HALF_ROTATION_CASES, ids=["two-fused", "local-split", "scan-gate_in_scan",
                                                           "out-fused-ranks", "defer-gate", "dqk-split",
                                                           "two-split-span-out"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_production_half_rotation(check_kernel, case, dtype):
    """The bias add and rotation in the products' 16-bit dtype meet the contract in every stage that takes them."""
    check_kernel("production", B=1, S=70, H=2, G=case["G"], N=64, P=48, R=case["R"], chunk_size=16, dtype=dtype,
                 config=case["config"])


# chunk_scan's intra-chunk weights once a (row, column token) (out_token_weights): raw_y stored over a tail chunk;
# the gate in chunk_scan with a padding rank (R = 3 in a tile of 4); spans of two chunks (the span's re-based
# column decays) in the half rotation's low-register order with GQA; one rank (a [rows, tokens, 1] view) with local
# states, the gate and qk_dot deferred.  The scores weighed before the v / Psi loads (out_early_mixing) with the
# padding rank and the one rank, and alone with raw_y stored.
TOKEN_WEIGHTS_CASES = [
    dict(R=2, G=1, S=70, chunk_size=16, config=ScanConfig(block_p=32, n_segments=3, block_half=16, out_block_p=32,
                                                          split_gate=True, out_token_weights=True)),
    dict(R=3, G=1, S=45, chunk_size=8, config=ScanConfig(block_p=16, n_segments=2, out_block_p=32, split_gate=True,
                                                         gate_in_scan=True, out_token_weights=True,
                                                         out_early_mixing=True)),
    dict(R=2, G=2, S=53, chunk_size=8, config=ScanConfig(block_p=32, n_segments=2, out_block_p=32, split_gate=True,
                                                         out_span_chunks=2, end_span_chunks=2, out_half_rotation=True,
                                                         out_q_cast_early=True, out_y_state_early=True,
                                                         out_token_weights=True)),
    dict(R=1, G=1, S=61, chunk_size=16, config=ScanConfig(block_p=16, n_segments=2, out_block_p=32, local_states=True,
                                                          split_gate=True, gate_in_scan=True, out_span_chunks=2,
                                                          out_defer_qk_dot=True, out_token_weights=True,
                                                          out_early_mixing=True)),
    dict(R=2, G=1, S=70, chunk_size=16, config=ScanConfig(block_p=32, n_segments=3, block_half=16, out_block_p=32,
                                                          split_gate=True, out_early_mixing=True)),
]


@pytest.mark.parametrize("case", TOKEN_WEIGHTS_CASES, ids=["raw_y-tail", "gate-pad_rank-early", "span-gqa-half",
                                                       "r1-local-early", "early-raw_y"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_production_token_weights(check_kernel, case, dtype):
    """chunk_scan weighing the scores viewed as [rows, tokens, ranks], or before the v / Psi loads, meets the contract
    in both of its forms."""
    check_kernel("production", B=1, S=case["S"], H=2, G=case["G"], N=32, P=48, R=case["R"],
                 chunk_size=case["chunk_size"], dtype=dtype, config=case["config"])


def test_half_rotation_rounding(request, device):
    """fp16 activations, fp32 outputs: the rotation in fp16 costs at most twice the fp32 rotation's error.

    The rotated columns (n < RD) take the bias add's, two products' and (at the GPU's fma) one sum's rounding
    instead of one rounding of the fp32 result; in the interpreter every output's normwise error grew 1.05-1.4x
    (S = 70, N = 64).  In bf16 the same steps measured 1.1-1.6x in a float64 emulation of the rotation alone
    (docs/optimization.md section 29).
    """
    inputs = make_inputs(B=1, S=70, H=2, G=1, N=64, P=48, R=2, chunk_size=16, dtype=F16, device=device,
                         seed=seed_for(request.node.nodeid))
    golden = bwd_fwd_reference(**{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in inputs.items()})
    base = ScanConfig(block_p=16, n_segments=2, out_block_p=16, local_states=True, split_gate=True)
    errors = {}
    for half in (False, True):
        config = dataclasses.replace(base, scan_half_rotation=half, out_half_rotation=half)
        got = api.bwd_fwd(**inputs, output_dtype=F32, impl="production", config=config)
        errors[half] = [((x.cpu().double() - g).norm() / g.norm()).item() for x, g in zip(got, golden)]
    for fp32_math, half_math in zip(errors[False], errors[True]):
        assert half_math <= 2 * fp32_math, errors


@pytest.mark.parametrize("gate_in_scan", [False, True])
@pytest.mark.parametrize("d_in_gate", [False, True])
def test_split_stage_rounds_like_the_fused_one(request, device, d_in_gate, gate_in_scan):
    """fp16 activations (fp16 products, also in the interpreter), fp32 outputs: the split output stage's dPhi and dz
    are as close to float64 as the fused stage's, which adds the D skip in fp32.

    chunk_scan folded D into the mixing matrix's diagonal, so D psiv went through the product's fp16 operands; where
    it is most of raw_y (short sequences) dPhi's MERE came out 1.7-5x the fused stage's, and on the GPU (bf16) the
    pairwise grid's dual benchmark failed on 2 of 128 random inputs (benchmarks/scratch_margins.py).  Both places of
    the D skip (chunk_scan after its products, or the gate's math: d_in_gate), with the gate in gate_grads or in
    chunk_scan.
    """
    inputs = make_inputs(B=2, S=64, H=2, G=2, N=64, P=64, R=4, chunk_size=16, dtype=F16, device=device,
                         seed=seed_for(request.node.nodeid))
    golden = bwd_fwd_reference(**{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in inputs.items()})
    base = ScanConfig(block_p=32, n_segments=2, out_block_p=64, out_num_warps=4)
    errors = {}
    split = dataclasses.replace(base, split_gate=True, d_in_gate=d_in_gate, gate_in_scan=gate_in_scan)
    for name, config in (("split", split), ("fused", base)):
        got = api.bwd_fwd(**inputs, output_dtype=F32, impl="production", config=config)
        errors[name] = [mere_mare(got[i].cpu(), golden[i])[0] for i in (2, 4)]  # dmimo_o, dz
    for split, fused in zip(errors["split"], errors["fused"]):
        assert split <= 1.25 * fused + 1e-6, errors


@pytest.mark.skipif(HAS_CUDA, reason="needs the interpreter, whose products are fp32-exact (bf16 GPU products round)")
@pytest.mark.parametrize("half_raw_y,bound", [(False, 1e-5), (True, 1e-3)])
def test_split_gate_scratch_rounding(check_kernel, monkeypatch, half_raw_y, bound):
    """bf16 activations, fp32 outputs: what the raw_y scratch between chunk_scan and gate_grads rounds.

    dz sums raw_y over ranks, so where the terms cancel the scratch's rounding shows in full: with raw_y
    stored in bf16 (2^-9), dz came out 3e-3 off normwise here (1e-7 in fp32), and on the GPU its MERE went
    over the dual benchmark (test_gpu_pairwise B1-S32-H2-bf16-Z-D-G1 at 9d55f71).  The fp16 scratch with a
    power-of-two scale per row (2^-12) measured 2.4e-4 (dz) and 3.1e-4 (dPhi) here; fp32 stays below 1e-5.
    The rotation tables are held at fp32: bf16 activations get fp16 tables, whose 2^-12 shows at ~1e-5 in the
    interpreter's fp32 products (on the GPU the products take bf16 operands, 2^-9), and this test measures the
    scratch alone.
    """
    monkeypatch.setattr(production, "rotation_table_dtype", lambda *dtypes: torch.float32)
    # No launch plan: the call runs its wrappers (a recorded call of the same key would replay fp16 tables).
    monkeypatch.setattr(api, "launch_plan_key", lambda *args: None)
    config = ScanConfig(block_p=16, n_segments=1, out_block_p=16, split_gate=True, half_raw_y=half_raw_y)
    checks = check_kernel("production", B=1, S=32, H=2, G=1, N=32, P=16, R=2, chunk_size=16, dtype=BF16, z=True,
                          d=True, output_dtype=F32, config=config)
    normwise = {c.name: c.normwise for c in checks if c.name in ("dz", "dmimo_o")}
    assert max(normwise.values()) < bound, normwise


def pad_to_whole_chunks(inputs):
    """The host padding of SPEC section 4: S -> nch * C."""
    C = inputs["chunk_size"]
    B, S = inputs["q"].shape[:2]
    nch = -(-S // C)
    pad = nch * C - S
    out = dict(inputs)

    def zeros_after(x, dim):
        shape = list(x.shape)
        shape[dim] = pad
        return torch.cat([x, x.new_zeros(shape)], dim=dim)

    for name in ("q", "k", "v", "dout", "angles", "z"):
        out[name] = zeros_after(inputs[name], 1)
    for name in ("dt", "trap"):
        out[name] = zeros_after(inputs[name], 2)
    da_cs = inputs["da_cs"]
    da_cs = torch.cat([da_cs, da_cs[..., -1:].expand(*da_cs.shape[:2], pad)], dim=2)
    last = da_cs[..., (nch - 1) * C:]  # the last chunk, now whole
    out["da_cs"] = da_cs
    out["da_cs_rev"] = torch.cat([inputs["da_cs_rev"][..., :(nch - 1) * C], last[..., -1:] - last], dim=2)
    earlier = torch.ones(C, C, dtype=torch.bool, device=da_cs.device).tril(-1)
    segsum = inputs["segsum"].clone()
    segsum[:, :, -1] = torch.where(earlier, last[..., :, None] - last[..., None, :], 0.0)
    out["segsum"] = segsum
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_tail_equals_explicit_padding(device, poison_outputs, impl):
    """Virtual padding in the kernels = padding on the host: valid outputs and states agree."""
    inputs = make_inputs(B=2, S=33, H=2, N=16, P=16, R=2, chunk_size=16, dtype=F32, device=device,
                         seed=seed_for("padding", impl))
    padded = pad_to_whole_chunks(inputs)
    assert padded["q"].shape[1] == 48 and padded["segsum"].shape == inputs["segsum"].shape
    got = api.bwd_fwd(**inputs, impl=impl)
    want = api.bwd_fwd(**padded, impl=impl)
    states, qk_dot, dmimo_o, dmimo_z, dz = want
    want = (states, qk_dot[:, :, :33], dmimo_o, dmimo_z, dz[:, :33])
    for name, x, y in zip(("states", "qk_dot", "dmimo_o", "dmimo_z", "dz"), got, want):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# --- SPEC section 8 grids, GPU only ---------------------------------------------------------------

GPU_FACTORS = dict(B=(1, 2), S=(32, 64), H=(2, 4), dtype=(F16, BF16, F32), Z=(True, False), D=(True, False),
                   G=("1", "H/2", "H"))
GPU_ROWS = covering_array(GPU_FACTORS)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("row", GPU_ROWS, ids=row_id)
@pytest.mark.gpu
@requires_cuda
def test_gpu_pairwise(check_kernel, impl, row):
    check_kernel(impl, B=row["B"], S=row["S"], H=row["H"], G=group_count(row["G"], row["H"]), N=64, P=64, R=4,
                 chunk_size=16, dtype=row["dtype"], z=row["Z"], d=row["D"], output_dtype=row["dtype"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("C", [16, 32])
@pytest.mark.parametrize("S", [33, 40, 48, 50])
@pytest.mark.gpu
@requires_cuda
def test_gpu_tail(check_kernel, impl, S, C):
    check_kernel(impl, B=2, S=S, H=4, G=2, N=64, P=64, R=2, chunk_size=C, dtype=BF16, output_dtype=F32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("R", [1, 2, 3, 4, 6, 8])
@pytest.mark.gpu
@requires_cuda
def test_gpu_rank(check_kernel, impl, R):
    check_kernel(impl, B=2, S=64, H=4, G=1, N=64, P=64, R=R, chunk_size=16, dtype=F32)


# Chunks of 128 and 256 (token, rank) rows at full width, walked as inner chunks of 64 rows: before, the output
# stage took 160 / 288 KB of shared memory at N = 256 (over an H200's 227 KB at C = 64) and 160 KB at N = 128.
@pytest.mark.parametrize("shape", ["N256_P64_R4_C64", "N256_P64_R4_C32", "N128_P128_R4_C64", "N64_P64_R8_C16"])
@pytest.mark.gpu
@requires_cuda
def test_gpu_inner_chunks(check_kernel, shape):
    check_kernel("production", B=2, S=1000, H=4, G=1, **parse_shape(shape), dtype=BF16, output_dtype=BF16,
                 ref_device="kernel")


OFFICIAL_SHAPES = ("N16_P64_R4_C8", "N32_P64_R4_C16", "N64_P64_R4_C16", "N128_P64_R4_C16", "N256_P64_R4_C8",
                   "N64_P128_R4_C16", "N128_P32_R4_C16", "N128_P128_R4_C8", "N128_P64_R8_C8", "N128_P64_R2_C32",
                   "N128_P64_R1_C64")
QUICK_SHAPES = ("N16_P64_R4_C8", "N256_P64_R4_C8", "N64_P128_R4_C16", "N128_P64_R2_C32", "N128_P64_R1_C64")
GRID_SHAPES = OFFICIAL_SHAPES if os.environ.get("MAMBA3_MIMO_FULL_GRID") == "1" else QUICK_SHAPES


def parse_shape(shape):
    """"N128_P64_R4_C16" -> dict(N=128, P=64, R=4, chunk_size=16)."""
    sizes = {part[0]: int(part[1:]) for part in shape.split("_")}
    return dict(N=sizes["N"], P=sizes["P"], R=sizes["R"], chunk_size=sizes["C"])


def test_quick_grid_is_a_cover():
    assert set(QUICK_SHAPES) <= set(OFFICIAL_SHAPES) and len(QUICK_SHAPES) == 5
    quick = [parse_shape(s) for s in QUICK_SHAPES]
    assert {s["R"] for s in quick} == {1, 2, 4}
    assert min(s["N"] for s in quick) == 16 and max(s["N"] for s in quick) == 256
    assert {s["P"] for s in quick} == {64, 128}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", GRID_SHAPES)
@pytest.mark.gpu
@requires_cuda
def test_official_grid(check_kernel, impl, shape):
    # The float64 reference of this size is slow on the CPU: it runs on the GPU as well.
    check_kernel(impl, B=4, S=2048, H=16, G=1, dtype=BF16, z=True, d=True, output_dtype=BF16,
                 ref_device="kernel", **parse_shape(shape))


@pytest.mark.parametrize("shape", GRID_SHAPES)
@pytest.mark.gpu
@requires_cuda
def test_official_grid_without_z(check_kernel, shape):
    """The official shapes without the gate, production only: the dispatcher routes them to another output
    stage than with Z (chunk_scan applying the gate, no gate_grads pass), so they get their own full-size check."""
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=False, d=True, output_dtype=BF16,
                 ref_device="kernel", **parse_shape(shape))


@pytest.mark.parametrize("shape", GRID_SHAPES)
@pytest.mark.gpu
@requires_cuda
def test_official_grid_fused_output(check_kernel, shape):
    """The dispatcher's config for the fused output stage (chunk_output), which the official shapes no
    longer take: it stays callable through ScanConfig and must stay exact."""
    sizes = parse_shape(shape)
    fused = _official_config(sizes, split_gate=False)
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=True, d=True, output_dtype=BF16,
                 ref_device="kernel", config=fused, **sizes)


def _official_config(sizes, **knobs):
    """The dispatcher's config for an official shape (``sizes``, parsed) at the official B, H and S on this GPU."""
    from mamba3_mimo.ops.production import choose_config

    return choose_config(B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                         **knobs, **sizes)


def _fused_tiles(monkeypatch):
    """The P tile of each fused storing scan launch the test's calls make (``gluon_scan_outputs.scan_outputs``)."""
    from mamba3_mimo.ops import gluon_scan_outputs

    tiles = []
    fused = gluon_scan_outputs.scan_outputs
    monkeypatch.setattr(gluon_scan_outputs, "scan_outputs", lambda **kw: (tiles.append(kw["block_p"]), fused(**kw))[1])
    return tiles


@pytest.mark.parametrize("shape", ["N128_P64_R4_C16", "N128_P64_R8_C8", "N128_P64_R2_C32"])
@pytest.mark.gpu
@requires_cuda
def test_official_scan_outputs_64(check_kernel, monkeypatch, shape):
    """The official N = 128, P = 64 shapes through the fused storing scan over its 64-wide P tile (q rotated in
    place; optimization.md section 52): timed to win there; the dispatcher took it (``SCAN_OUTPUTS_P``) once this
    full-size check had passed on a GPU (section 53), and it is kept whatever the dispatcher says."""
    tiles = _fused_tiles(monkeypatch)
    sizes = parse_shape(shape)
    chosen = _official_config(sizes)
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=True, d=True, output_dtype=BF16,
                 ref_device="kernel", config=dataclasses.replace(chosen, scan_outputs=True), **sizes)
    assert tiles and set(tiles) == {64}, tiles


@pytest.mark.parametrize("shape,gluon_gate", [
    (shape, gluon_gate) for shape in ("N128_P64_R4_C16", "N128_P32_R4_C16", "N128_P64_R8_C8", "N128_P64_R2_C32")
    for gluon_gate in ((False, True) if "_R2_" not in shape else (False,))])  # the Gluon gate_grads: R = 4, 8
@pytest.mark.gpu
@requires_cuda
def test_official_scan_outputs_without_z(check_kernel, monkeypatch, shape, gluon_gate):
    """The official N = 128, C * R = 64 shapes without Z through the fused storing scan and a gate_grads pass, full
    size: the candidates of the Z-off sweep in section 53, and the path the dispatcher's configs fall back to where
    the gate in the pass (``scan_outputs_gate``, section 55) does not cover a call."""
    from mamba3_mimo.ops.production import choose_config, gate_tokens_per_program

    sizes = parse_shape(shape)
    calls = _fused_tiles(monkeypatch)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen = choose_config(B=4, H=16, S=2048, num_sms=num_sms, has_z=False, **sizes)
    config = dataclasses.replace(chosen, gate_in_scan=False, scan_outputs=True, scan_outputs_gate=False,
                                 gluon_gate=gluon_gate,
                                 gate_tokens=gate_tokens_per_program(B=4, H=16, S=2048, R=sizes["R"], P=sizes["P"],
                                                                     num_sms=num_sms))
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=False, d=True, output_dtype=BF16,
                 ref_device="kernel", config=config, **sizes)
    assert calls, "the fused storing scan did not run"


@pytest.mark.parametrize("shape", ["N128_P64_R4_C16", "N128_P32_R4_C16", "N128_P64_R8_C8", "N128_P64_R2_C32"])
@pytest.mark.parametrize("z", [True, False], ids=["z", "noz"])
@pytest.mark.gpu
@requires_cuda
def test_official_scan_outputs_gate(check_kernel, monkeypatch, shape, z):
    """The official N = 128, C * R = 64 shapes at full size with the gate applied inside the fused storing scan
    (``scan_outputs_gate``, optimization.md section 54): no gate_grads launch, dz and the Phi / Zeta gradients from
    the segments' partials, with Z and without."""
    sizes = parse_shape(shape)
    calls = _fused_tiles(monkeypatch)
    gates = spy_gate_grads(monkeypatch)
    chosen = _official_config(sizes, has_z=z)
    config = dataclasses.replace(chosen, gate_in_scan=False, scan_outputs=True, scan_outputs_gate=True)
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=z, d=True, output_dtype=BF16,
                 ref_device="kernel", config=config, **sizes)
    assert calls and not gates, (calls, gates)


@pytest.mark.parametrize("shape", ["N64_P64_R4_C16", "N64_P128_R4_C16"])
@pytest.mark.parametrize("z", [True, False], ids=["z", "noz"])
@pytest.mark.gpu
@requires_cuda
def test_official_scan_outputs_n64(check_kernel, monkeypatch, shape, z):
    """The official N = 64, C * R = 64 shapes at full size through the fused storing scan (both N/2 halves stacked
    in one 64-row state; optimization.md section 55), its weights through the ring: raw_y for gate_grads with Z (over
    a 128-wide tile at P = 128), the gate in the pass without Z."""
    sizes = parse_shape(shape)
    tiles = _fused_tiles(monkeypatch)
    gates = spy_gate_grads(monkeypatch)
    chosen = _official_config(sizes, has_z=z)
    config = dataclasses.replace(chosen, gate_in_scan=False, scan_outputs=True, scan_outputs_gate=not z,
                                 scan_outputs_ring_weights=True)
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=z, d=True, output_dtype=BF16,
                 ref_device="kernel", config=config, **sizes)
    assert tiles and set(tiles) == {sizes["P"] if z else 64}, tiles
    assert bool(gates) is z, gates


@pytest.mark.parametrize("shape", ["N64_P128_R4_C16", "N128_P64_R4_C16"])
@pytest.mark.gpu
@requires_cuda
def test_official_scan_outputs_d_skip(check_kernel, monkeypatch, shape):
    """The fused storing scan adding the D skip to raw_y itself (``scan_outputs_d_skip``, optimization.md section 55),
    full size with Z: over N64_P128's 128-wide tile and N128_P64's 64-wide one (q rotated in place); gate_grads adds
    no skip."""
    sizes = parse_shape(shape)
    tiles = _fused_tiles(monkeypatch)
    gates = spy_gate_grads(monkeypatch)
    chosen = _official_config(sizes)
    config = dataclasses.replace(chosen, scan_outputs=True, scan_outputs_d_skip=True)
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=True, d=True, output_dtype=BF16,
                 ref_device="kernel", config=config, **sizes)
    assert tiles and gates and not any(with_d for _, with_d in gates), (tiles, gates)


@pytest.mark.parametrize("shape", ["N256_P64_R4_C8", "N128_P128_R4_C8"])
@pytest.mark.parametrize("knobs", [dict(n_segments=1), dict(gluon_segments=1), dict(gluon_segments=1, block_p=32)],
                         ids=["one-segment", "one-gluon-segment", "one-gluon-segment-p32"])
@pytest.mark.gpu
@requires_cuda
def test_official_two_pass_scan_segments(check_kernel, shape, knobs):
    """The two-pass shapes with their state scan in one segment (no end-state pass: each program walks every chunk),
    for every scan or for the Gluon one (``gluon_segments``), and with 32-wide P tiles: the candidates of
    sweep_prepared.sh part 19 against the dispatcher's two segments (section 39)."""
    sizes = parse_shape(shape)
    chosen = _official_config(sizes)
    assert not chosen.local_states  # the two-pass schedule, where n_segments sets the end-state pass
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=True, d=True, output_dtype=BF16,
                 ref_device="kernel", config=dataclasses.replace(chosen, **knobs), **sizes)


@pytest.mark.parametrize("shape", ["N16_P64_R4_C8", "N32_P64_R4_C16"])
@pytest.mark.parametrize("z", [True, False], ids=["Z", "noZ"])
@pytest.mark.gpu
@requires_cuda
def test_official_wide_narrow_scan(check_kernel, monkeypatch, shape, z):
    """The dispatcher's config with ``production.WIDE_NARROW_SCAN`` on (the N <= 32 local-state scan over all of
    P = 64, twice the segments; timed in section 42: N16 / N32 -7 to -8%), full size, with and without Z: the test
    that let the dispatcher take it (passed on an H100 at 7308696, section 43), kept for when the flag is off."""
    sizes = parse_shape(shape)
    monkeypatch.setattr(production, "WIDE_NARROW_SCAN", True)
    production.choose_config.cache_clear()
    try:
        config = production.choose_config(
            B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count, has_z=z, **sizes)
    finally:
        production.choose_config.cache_clear()  # no config of the flag's outlives the test
    assert config.local_states and config.block_half == 16 and config.block_p == sizes["P"]
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=z, d=True, output_dtype=BF16,
                 ref_device="kernel", config=config, **sizes)


@pytest.mark.parametrize("shape", QUICK_SHAPES)
@pytest.mark.parametrize("z", [True, False], ids=["Z", "noZ"])
@pytest.mark.gpu
@requires_cuda
def test_official_pdl(check_kernel, shape, z):
    """``ScanConfig.pdl`` (programmatic dependent launch, section 40) lets a kernel's programs start while the previous
    kernel finishes; each waits before reading its output.  On the official shapes: the accuracy contract against the
    reference, and two calls bitwise equal (a kernel reading its predecessor's output too early would make the calls
    differ).  Not bitwise the same config without PDL: where the wait moves work (chunk_scan's table loads), the
    compiler orders the arithmetic differently, and on the H100 up to 13% of qk_dot moved by one bf16 ulp at R <= 2,
    the same in every call (``benchmarks/pdl_diag.py``)."""
    sizes = parse_shape(shape)
    chosen = _official_config(sizes, has_z=z)
    config = dataclasses.replace(chosen, pdl=True)
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=z, d=True, output_dtype=BF16,
                 ref_device="kernel", config=config, **sizes)
    inputs = make_inputs(B=4, S=2048, H=16, G=1, **sizes, dtype=BF16, z=z, d=True, device="cuda",
                         seed=seed_for("pdl", shape, z))
    first = api.bwd_fwd(**inputs, output_dtype=BF16, config=config)
    for _ in range(2):
        again = api.bwd_fwd(**inputs, output_dtype=BF16, config=config)
        for name, a, b in zip(("states", "qk_dot", "dmimo_o", "dmimo_z", "dz"), first, again):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b), name


@pytest.mark.parametrize("shape", GRID_SHAPES)
@pytest.mark.gpu
@requires_cuda
def test_official_fold_one_scan_with_pdl(check_kernel, shape):
    """The official shapes with the two knobs of section 40 on: the segment fold as one scan over the segments
    (where local states run) and programmatic dependent launch, against the reference at full size."""
    sizes = parse_shape(shape)
    chosen = _official_config(sizes)
    check_kernel("production", B=4, S=2048, H=16, G=1, dtype=BF16, z=True, d=True, output_dtype=BF16,
                 ref_device="kernel", config=dataclasses.replace(chosen, fold_one_scan=True, pdl=True), **sizes)


@pytest.mark.gpu
@requires_cuda
def test_chunk_scan_refuses_the_miscompiled_tile(device):
    """A 32-wide P tile at N/2 = 64 gave wrong values on the H200 (Triton 3.6), a 16-wide one at N = 64, R = 4 wrong
    values or an illegal address on the H100: refused before launch."""
    inputs = make_inputs(B=1, S=32, H=2, N=128, P=64, R=2, chunk_size=16, dtype=BF16, device=device, seed=3)
    config = ScanConfig(block_p=64, n_segments=1, block_half=64, out_block_p=32, split_gate=True)
    with pytest.raises(ValueError, match="miscompiles"):
        api.bwd_fwd(**inputs, config=config)
    # A 16-wide tile at N = 64, R = 4 with 16-bit products: wrong values or an illegal address on the H100 (section 45).
    inputs = make_inputs(B=1, S=70, H=2, N=64, P=48, R=4, chunk_size=16, dtype=BF16, device=device, seed=3)
    config = ScanConfig(block_p=16, n_segments=2, out_block_p=16, local_states=True, split_gate=True)
    with pytest.raises(ValueError, match="R = 4 miscompiles"):
        api.bwd_fwd(**inputs, config=config)


@pytest.mark.parametrize("N,R,block_p,dot_dtype,refused", [
    (128, 2, 32, tl.bfloat16, True), (128, 2, 64, tl.bfloat16, False),
    (64, 4, 16, tl.bfloat16, True), (64, 3, 16, tl.float16, True), (64, 4, 16, tl.float32, False),
    (64, 2, 16, tl.bfloat16, False), (64, 4, 32, tl.bfloat16, False), (32, 4, 16, tl.bfloat16, False),
])
def test_miscompiled_tile_rule(N, R, block_p, dot_dtype, refused):
    """The tiles chunk_scan refuses on the GPU: narrower than 64 at N/2 >= 64; narrower than 32 at N/2 >= 32 with four
    rank rows a token (R = 3 pads to 4) and 16-bit products.  The rest, seen to pass on the GPU, are let through."""
    meta = chunk_scan_meta(chunk_size=16, R=R, N=N, block_p=block_p)
    if refused:
        with pytest.raises(ValueError, match="miscompiles"):
            refuse_miscompiled_tile(meta, block_p=block_p, N=N, R=R, dot_dtype=dot_dtype)
    else:
        refuse_miscompiled_tile(meta, block_p=block_p, N=N, R=R, dot_dtype=dot_dtype)
