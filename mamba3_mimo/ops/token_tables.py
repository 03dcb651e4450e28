"""Stage 0 of the production path: the per-token tables every later kernel reads, in one launch.

    gamma[t]      = dt[t] * sigmoid(trap[t])                          (weight of token t on itself)
    trap_scale[t] = gamma[t] + dt[t+1] * sigmoid(-trap[t+1])          (weight of token t on later tokens;
                                                                       no next token after S - 1)
    cos_angles, sin_angles = cos(angles), sin(angles)                 (the rotation of q and k; fp32, fp16
                                                                       where the products take bf16, or the
                                                                       products' dtype where the rotation
                                                                       runs in it)

Every later stage reads these tables instead of loading dt and trap at t and t + 1 with two sigmoids
for each (token, rank) row of every tile, or taking cos / sin per row (which doubled the scan's
registers).  One kernel writes all four: two torch calls for cos / sin cost a launch each.
"""

import torch
import triton
import triton.language as tl

from . import host_utils
from .host_utils import cdiv, next_power_of_2
from .launch import launch
from .triton_utils import table_cos_sin, trapezoid_weights, wait_for_previous_grid

BLOCK_TOKENS = 256
# Elements of angles per step (tokens x RD): 4 a thread at 4 warps.
ANGLES_PER_STEP = 512


@triton.jit
def _weight_tables(dt_ptr, trap_ptr, gamma_ptr, trap_scale_ptr, seq, t, valid, next_valid):
    """gamma and trap_scale of tokens ``t`` of the [B * H, S] row starting at ``seq``, stored where ``valid``; the
    next token's dt and trap are read where ``next_valid`` (not past the row's last token)."""
    dt = tl.load(dt_ptr + seq + t, mask=valid, other=0.0).to(tl.float32)
    trap = tl.load(trap_ptr + seq + t, mask=valid, other=0.0).to(tl.float32)
    dt_next = tl.load(dt_ptr + seq + t + 1, mask=next_valid, other=0.0).to(tl.float32)
    trap_next = tl.load(trap_ptr + seq + t + 1, mask=next_valid, other=0.0).to(tl.float32)
    gamma, trap_scale = trapezoid_weights(dt, trap, dt_next, trap_next)
    tl.store(gamma_ptr + seq + t, gamma, mask=valid)
    tl.store(trap_scale_ptr + seq + t, trap_scale, mask=valid)


@triton.jit
def _cos_sin_tables(angles_ptr, cos_ptr, sin_ptr, angle_offs, angle_mask, FAST_TRIG: tl.constexpr):
    """cos and sin of the angles at ``angle_offs``, stored at the same offsets of the tables."""
    theta = tl.load(angles_ptr + angle_offs, mask=angle_mask, other=0.0)
    cos, sin = table_cos_sin(theta, cos_ptr.dtype.element_ty, FAST_TRIG)
    tl.store(cos_ptr + angle_offs, cos, mask=angle_mask)
    tl.store(sin_ptr + angle_offs, sin, mask=angle_mask)


@triton.jit
def _token_tables_kernel(dt_ptr, trap_ptr, angles_ptr, gamma_ptr, trap_scale_ptr, cos_ptr, sin_ptr, S, H, RD,
                         BLOCK_T: tl.constexpr, BLOCK_RD: tl.constexpr, ANGLE_ROWS: tl.constexpr,
                         FAST_TRIG: tl.constexpr, GDC: tl.constexpr = False):
    wait_for_previous_grid(GDC)
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = t < S
    next_valid = (t + 1) < S
    _weight_tables(dt_ptr, trap_ptr, gamma_ptr, trap_scale_ptr, bh * S, t, valid, next_valid)

    # angles [B, S, H, RD]: this program's tokens of head h, ANGLE_ROWS tokens a step (every element a thread
    # holds inlines its own cos and sin, so small steps keep the code small).  On the GPU, fast_cos_sin:
    # libdevice's versions over a whole [BLOCK_T, BLOCK_RD] tile compiled to 8.5K PTX lines, and even in
    # steps they ran at about half the copy bandwidth (21 us at N = 64, 39 at N = 256).
    b, h = bh // H, bh % H
    cols = tl.arange(0, BLOCK_RD)
    for step in range(BLOCK_T // ANGLE_ROWS):
        t_step = tl.program_id(0) * BLOCK_T + step * ANGLE_ROWS + tl.arange(0, ANGLE_ROWS)
        angle_offs = ((b * S + t_step[:, None]) * H + h) * RD + cols[None, :]
        angle_mask = (t_step[:, None] < S) & (cols[None, :] < RD)
        _cos_sin_tables(angles_ptr, cos_ptr, sin_ptr, angle_offs, angle_mask, FAST_TRIG)


# The flat form (``token_tables(flat=True)``): tokens of one weight-table row and elements of angles per program.
FLAT_WEIGHTS = 512
FLAT_ANGLES = 2048


@triton.jit
def _flat_token_tables_kernel(dt_ptr, trap_ptr, angles_ptr, gamma_ptr, trap_scale_ptr, cos_ptr, sin_ptr, S,
                              N_ROWS, N_ANGLES, BLOCK_W: tl.constexpr, BLOCK_A: tl.constexpr,
                              FAST_TRIG: tl.constexpr, GDC: tl.constexpr = False, COS_SIN: tl.constexpr = True):
    """_token_tables_kernel with cos / sin as an elementwise map over angles [B * S * H * RD], flat, which keeps
    every load and store contiguous whatever RD and H are (per (b, h) the angle rows are RD elements H * RD
    apart).  Program i also takes the i-th token block of the [B * H, S] weight tables, if there is one.  Without
    COS_SIN only the weight tables are written (the kernels that rotate compute cos / sin from the angles)."""
    wait_for_previous_grid(GDC)
    pid = tl.program_id(0)
    blocks_per_row = tl.cdiv(S, BLOCK_W)
    row = pid // blocks_per_row
    t = (pid % blocks_per_row) * BLOCK_W + tl.arange(0, BLOCK_W)
    valid = (t < S) & (row < N_ROWS)
    _weight_tables(dt_ptr, trap_ptr, gamma_ptr, trap_scale_ptr, row.to(tl.int64) * S, t, valid, valid & (t + 1 < S))
    if COS_SIN:
        angle_offs = pid.to(tl.int64) * BLOCK_A + tl.arange(0, BLOCK_A)
        _cos_sin_tables(angles_ptr, cos_ptr, sin_ptr, angle_offs, angle_offs < N_ANGLES, FAST_TRIG)


def token_tables(*, dt, trap, angles, rotation_dtype=torch.float32, flat=False, cos_sin=True, weights=None):
    """(gamma, trap_scale, cos_angles, sin_angles) for the production kernels.

    Args (contiguous): dt [B, H, S] fp32, trap [B, H, S] (any float dtype), angles [B, S, H, RD] fp32;
        rotation_dtype: dtype of the cos / sin tables, fp32, fp16 (|values| <= 1: fp16 rounds them to
        2^-12 absolute, an eighth of the bf16 rounding the rotated rows get before bf16 products) or bf16
        (for a rotation computed in bf16: ``ScanConfig.scan_half_rotation`` with ``out_half_rotation``);
        flat: one flat index over each table (``_flat_token_tables_kernel``) instead of programs per (b, h)
        and token block; the same values;
        cos_sin: False writes the weight tables alone (the flat kernel without its angle map): where every kernel
        that rotates computes the tables' values from the angles itself (``table_cos_sin``);
        weights: a [2, B, H, S] fp32 tensor to write gamma and trap_scale into (default: a new one), for a caller
        that needs their addresses before the launch.
    Returns gamma, trap_scale: [B, H, S] fp32; cos_angles, sin_angles: [B, S, H, RD] rotation_dtype (views
    of one allocation each pair, so a call allocates twice), or None, None without ``cos_sin``.
    """
    if rotation_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"token_tables: rotation_dtype must be float32, float16 or bfloat16, got {rotation_dtype}")
    B, H, S = dt.shape
    RD = angles.shape[3]
    # The approximate units' 2^-20.9 absolute error is below a 16-bit table's rounding but ~4x fp32's: fp32 tables
    # (fp32 activations) take libdevice's cos / sin, or the outputs' worst relative errors reach 10x the fp32
    # reference's (states MARE, GPU, tests/test_kernels.py::test_production_half_rotation[fp32-out-fused-ranks]).
    fast_trig = host_utils.compiled_for_gpu(angles) and rotation_dtype != torch.float32
    if weights is None:
        weights = torch.empty((2, B, H, S), device=dt.device, dtype=torch.float32)
    if not cos_sin:
        launch(_flat_token_tables_kernel, (B * H * cdiv(S, FLAT_WEIGHTS),), dt, trap, angles, weights[0], weights[1],
               angles, angles, S, B * H, 0, BLOCK_W=FLAT_WEIGHTS, BLOCK_A=FLAT_ANGLES, FAST_TRIG=False,
               COS_SIN=False, num_warps=4)
        return weights[0], weights[1], None, None
    rotation = torch.empty((2,) + tuple(angles.shape), device=dt.device, dtype=rotation_dtype)
    if flat:
        n_angles = angles.numel()
        grid = (max(B * H * cdiv(S, FLAT_WEIGHTS), cdiv(n_angles, FLAT_ANGLES)),)
        launch(_flat_token_tables_kernel, grid, dt, trap, angles, weights[0], weights[1], rotation[0], rotation[1],
               S, B * H, n_angles, BLOCK_W=FLAT_WEIGHTS, BLOCK_A=FLAT_ANGLES,
               FAST_TRIG=fast_trig, num_warps=4)
        return weights[0], weights[1], rotation[0], rotation[1]
    block_rd = next_power_of_2(max(RD, 1))
    launch(_token_tables_kernel, (cdiv(S, BLOCK_TOKENS), B * H),
        dt, trap, angles, weights[0], weights[1], rotation[0], rotation[1], S, H, RD,
        BLOCK_T=BLOCK_TOKENS, BLOCK_RD=block_rd, ANGLE_ROWS=min(BLOCK_TOKENS, max(1, ANGLES_PER_STEP // block_rd)),
        FAST_TRIG=fast_trig, num_warps=4)
    return weights[0], weights[1], rotation[0], rotation[1]
