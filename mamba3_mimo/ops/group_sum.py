"""Last step of the production path: sum the output stage's per-group Phi / Zeta partials.

``chunk_output`` leaves one [R, P] partial per (b, h, chunk group); the gradients are their sums.
One kernel reduces both partial tensors and writes the outputs in their dtype, in a fixed order
(no atomics).  It replaces two ``torch.sum(dim=2)`` reductions and two casting copies, which took
about 25 us per call on the official shapes (profiler breakdown of 1315b8b) for ~17 MB of reads.
"""

import triton
import triton.language as tl

from .host_utils import cdiv, next_power_of_2
from .launch import launch
from .triton_utils import wait_for_previous_grid

# Partials summed per step (rows of the [groups, R*P] tile) and R*P columns per program.  Narrow column
# blocks give the launch its programs: with 128 columns the official shapes had B*H*R*P/128 = 128 programs
# (under one per SM), each walking its groups in serial steps, 16-40 us for 17-34 MB of partials.
BLOCK_GROUPS = 64
BLOCK_COLS = 32
# Over deep partials of both gradients (the single-chunk gated chunk_scan with Z: 256 chunks at N16, 34 MB of fp32)
# 256 groups a step at 8 warps.  Those partials come from DRAM, not L2: Nsight Compute put this kernel's L2 hit rate at
# 3% in the N16 call, where it took 19.7 us at 1.7 TB/s (docs/optimization.md section 44); more of them in flight a
# program helps.  H100, whole calls (graph us, benchmarks/group_sum_tune.py --in-call, 314890c): N16 with Z 206.3 ->
# 201.8; without Z (one partial tensor) 158.0 -> 156.7, and R8_C8 / N256 without Z (256 groups) 644.1 -> 649.9 /
# 652.1 -> 652.0: not taken.
WIDE_GROUPS = 256
WIDE_TILE = dict(block_groups=256, block_cols=32, num_warps=8)


def partials_tile(n_groups, has_z):
    """(groups a step, columns a program, warps) of ``sum_group_partials`` for partials ``n_groups`` deep."""
    if has_z and n_groups >= WIDE_GROUPS:
        return WIDE_TILE
    return dict(block_groups=BLOCK_GROUPS, block_cols=BLOCK_COLS, num_warps=4)


@triton.jit
def _group_sum_kernel(
    dphi_ptr, dzeta_ptr, dmimo_o_ptr, dmimo_z_ptr, N_GROUPS,
    RP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_RP: tl.constexpr, HAS_Z: tl.constexpr,
    GDC: tl.constexpr = False,
):
    wait_for_previous_grid(GDC)
    bh = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_RP + tl.arange(0, BLOCK_RP)
    col_mask = cols < RP
    rows = tl.arange(0, BLOCK_G)
    part_offs = bh * N_GROUPS * RP + rows[:, None] * RP + cols[None, :]
    dphi_sum = tl.zeros((BLOCK_RP,), dtype=tl.float32)
    dzeta_sum = tl.zeros((BLOCK_RP,), dtype=tl.float32)
    # A [BLOCK_G, BLOCK_RP] tile per step: many loads in flight, not one row per serial step.
    for g0 in range(0, N_GROUPS, BLOCK_G):
        mask = ((g0 + rows) < N_GROUPS)[:, None] & col_mask[None, :]
        dphi_sum += tl.sum(tl.load(dphi_ptr + part_offs + g0 * RP, mask=mask, other=0.0), axis=0)
        if HAS_Z:
            dzeta_sum += tl.sum(tl.load(dzeta_ptr + part_offs + g0 * RP, mask=mask, other=0.0), axis=0)
    out_offs = bh * RP + cols
    tl.store(dmimo_o_ptr + out_offs, dphi_sum.to(dmimo_o_ptr.dtype.element_ty), mask=col_mask)
    if HAS_Z:
        tl.store(dmimo_z_ptr + out_offs, dzeta_sum.to(dmimo_z_ptr.dtype.element_ty), mask=col_mask)


def sum_group_partials(*, dphi_partial, dzeta_partial, dmimo_o, dmimo_z, block_groups=None, block_cols=None,
                       num_warps=None, num_stages=None):
    """dmimo_o[b, h] = sum_g dphi_partial[b, h, g] (and dmimo_z from dzeta_partial), in place.

    Args:
        dphi_partial, dzeta_partial: [B, H, n_groups, R, P] fp32 contiguous (dzeta_partial may be None);
        dmimo_o, dmimo_z: [B, H, R, P] contiguous, any float dtype (dmimo_z None with dzeta_partial);
        block_groups, block_cols, num_warps, num_stages: the tile and launch, given only by
            ``benchmarks/group_sum_tune.py`` (None: ``partials_tile``'s, and Triton's default stages).
    """
    B, H, n_groups, R, P = dphi_partial.shape
    has_z = dzeta_partial is not None
    tile = partials_tile(n_groups, has_z)
    block_groups = tile["block_groups"] if block_groups is None else block_groups
    block_cols = tile["block_cols"] if block_cols is None else block_cols
    num_warps = tile["num_warps"] if num_warps is None else num_warps
    block_rp = min(block_cols, next_power_of_2(R * P))
    launch(_group_sum_kernel, (cdiv(R * P, block_rp), B * H),
        dphi_partial, dzeta_partial if has_z else dphi_partial, dmimo_o, dmimo_z if has_z else dmimo_o, n_groups,
        RP=R * P, BLOCK_G=min(block_groups, next_power_of_2(n_groups)), BLOCK_RP=block_rp, HAS_Z=has_z,
        num_warps=num_warps, **({} if num_stages is None else dict(num_stages=num_stages)),
    )
