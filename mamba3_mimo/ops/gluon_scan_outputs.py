"""The storing state scan with chunk_scan's products, as one warp-specialized Gluon kernel for Hopper.

In the two-pass schedule the storing scan (``gluon_state_scan``'s ``store`` role) holds the state entering each
chunk and writes it to ``states``; chunk_scan then reads every one of those states back (134 MB at
N128_P64_R4_C16, docs/optimization.md section 46) with q and k to form raw_y.  Here the storing pass forms raw_y
itself while the state is on chip (``ScanConfig.scan_outputs``, section 51):

    scores = q~ k~^T                                   [rows, rows]; same-token blocks are qk_dot
    raw_y  = (scores * W) psiv + exp(da_cs) (q~ @ state_in)          [rows, P tile]
    state  = exp(da_cs[C - 1]) state + k~^T @ (w psiv)               [N, P tile]

with the same rows as the scan's boxes, rank-major (row = r * C + t), and W the causal decay / trapezoid weights of
SPEC section 3.  The state entering the chunk is staged in shared memory in bf16 for its TMA store; the same buffer
is the B operand of q~ @ state_in, so raw_y sees the bf16 states that chunk_scan would have read.  k~ is rotated
once for the update and the scores.  raw_y goes to the scratch ``gate_grads`` reads (fp16 with a power of two per
row and P tile, or fp32), qk_dot from the first P tile's programs; the D skip is left to ``gate_grads``.

Partitions: a 1-warp producer streams each chunk's q and k (as [R, C, N/2] boxes of [R, B * S, G * N], both N/2
halves), cos / sin (or the fp32 angles) and v into a ring of shared-memory stages with TMA; the 4-warp consumer
rotates q and k, weighs v, releases the stage and runs the chunk's seven wgmma (four at N = 64, where both halves
are stacked in one 64-row state and one operand each, section 55).  One program per (P tile, segment, (b, h)) holds
the whole [N, P tile] state.  The P tile is 32 or 64 wide (``plan``; 128 at N = 64 without the gate): at 64 and
N = 128, separate q~ and k~ operands beside a ring stage do not fit, so q has a one-stage ring of its own and is
rotated where it lands (section 52).  What it covers (``unsupported``): a Hopper GPU, N = 64 or 128, P a multiple of
32, C * R = 64 (one wgmma M), C a multiple of 8, S a multiple of C, bf16 q / k / v and states, 16-bit tables or the
angles, within the 99 KB bound.  Like the Gluon scan, it does not run in the Triton interpreter: its values are
tested on the GPU (``tests/test_gluon_scan_outputs.py``).
"""

import functools
from typing import NamedTuple

import torch
import triton
from triton import knobs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .gluon_state_scan import (
    MAX_REGISTERS,
    PRODUCER_REGISTERS,
    SMEM_LIMIT,
    STATE_ROWS,
    _rows_layout,
    _state_layout,
    _store_entering_state,
    biased_rank_rows,
    descriptors,
    entering_segment_state,
    half_rows_layout,
    store_rotated_rows,
)
from .host_utils import cdiv, rotation_source
from .launch import launch
from .triton_utils import fp16_row_scaled, intra_chunk_weights, silu_and_grad, table_cos_sin

NS = (64, 128)  # the state sizes it covers: a program holds the whole [N, P tile] state
ROWS = 64  # C * R: one wgmma M, the rows of the scores and of raw_y
# The products' K over N: one N/2 half at N = 128, both halves stacked [lo | hi] at N = 64 (one 64-row state
# accumulator, as the Gluon scan's); a 128-byte swizzled bf16 row either way.
OPERAND_COLS = 64
_ROWS = gl.constexpr(ROWS)  # the same, for the kernels
_OPERAND_COLS = gl.constexpr(OPERAND_COLS)


@gluon.jit
def _producer(q_desc, k_desc, cos_desc, sin_desc, v_desc, q_lo_bufs, q_hi_bufs, k_lo_bufs, k_hi_bufs, cos_bufs,
              sin_bufs, v_bufs, weight_bufs, da_rev_ptr, trap_scale_ptr, ready, empty, q_ready, q_empty, b, h, g, bh,
              t_first, p0, S, n_steps, C: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr,
              FROM_ANGLES: gl.constexpr, Q_IN_PLACE: gl.constexpr, RING_WEIGHTS: gl.constexpr):
    HALF: gl.constexpr = N // 2
    NUM_BUFFERS: gl.constexpr = k_lo_bufs.type.shape[0]
    NUM_Q_BUFFERS: gl.constexpr = q_lo_bufs.type.shape[0]
    # From angles, cos_desc is the fp32 angles' box (as many bytes as a 16-bit cos box and sin box together).
    STEP_BYTES: gl.constexpr = ((2 if Q_IN_PLACE else 4) * k_desc.block_type.nbytes
                                + (2 - FROM_ANGLES) * cos_desc.block_type.nbytes + v_desc.block_type.nbytes)
    for i in range(n_steps):
        stage = i % NUM_BUFFERS
        # A fresh mbarrier counts as having completed phase 1, so the first pass through the ring does not wait.
        mbarrier.wait(empty.index(stage), ((i // NUM_BUFFERS) & 1) ^ 1)
        row = b * S + t_first + i * C
        bar = ready.index(stage)
        if RING_WEIGHTS:
            # The chunk's da_rev and trap_scale ([B * H, S] fp32), which the consumer needs first in the step, by
            # cp.async into the stage's weight rows; the stage's barrier also waits for them (each thread's arrive,
            # counted in, fires once its copies have landed).
            token = gl.arange(0, C, gl.BlockedLayout([1], [32], [1], [0]))
            at = bh * S + t_first + i * C
            async_copy.async_copy_global_to_shared(weight_bufs.index(2 * stage), da_rev_ptr + at + token)
            async_copy.async_copy_global_to_shared(weight_bufs.index(2 * stage + 1), trap_scale_ptr + at + token)
            async_copy.mbarrier_arrive(bar)
        mbarrier.expect(bar, STEP_BYTES)
        tma.async_copy_global_to_shared(k_desc, [0, row, g * N], bar, k_lo_bufs.index(stage))
        tma.async_copy_global_to_shared(k_desc, [0, row, g * N + HALF], bar, k_hi_bufs.index(stage))
        if not Q_IN_PLACE:
            tma.async_copy_global_to_shared(q_desc, [0, row, g * N], bar, q_lo_bufs.index(stage))
            tma.async_copy_global_to_shared(q_desc, [0, row, g * N + HALF], bar, q_hi_bufs.index(stage))
        tma.async_copy_global_to_shared(cos_desc, [row, h * RD], bar, cos_bufs.index(stage))
        if not FROM_ANGLES:
            tma.async_copy_global_to_shared(sin_desc, [row, h * RD], bar, sin_bufs.index(stage))
        tma.async_copy_global_to_shared(v_desc, [row, h * P + p0], bar, v_bufs.index(stage))
        if Q_IN_PLACE:
            # q has its own ring: the consumer rotates it where it lands and frees it once q~'s products are done,
            # later in the step than k's stage.
            q_stage = i % NUM_Q_BUFFERS
            mbarrier.wait(q_empty.index(q_stage), ((i // NUM_Q_BUFFERS) & 1) ^ 1)
            q_bar = q_ready.index(q_stage)
            mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [0, row, g * N], q_bar, q_lo_bufs.index(q_stage))
            tma.async_copy_global_to_shared(q_desc, [0, row, g * N + HALF], q_bar, q_hi_bufs.index(q_stage))


@gluon.jit
def _rotate_into(lo_rows, hi_rows, bias_lo, bias_hi, cos, sin, out_lo, out_hi, r, C: gl.constexpr,
                 layout: gl.constexpr, ROTATION_DTYPE: gl.constexpr, STACKED: gl.constexpr = False):
    """Rank ``r``'s [C, N/2] rows of q or k from the stage: bias added, rotated, stored as bf16 operand rows (both
    halves in ``out_lo`` where STACKED)."""
    x_lo, x_hi = biased_rank_rows(lo_rows, hi_rows, bias_lo, bias_hi, r, C, layout, ROTATION_DTYPE)
    store_rotated_rows(x_lo, x_hi, cos, sin, out_lo, out_hi, r, C, STACKED)


@gluon.jit
def _weigh_psiv(v_rows, v_weighted, psi_smem, psiv_w_smem, psiv_smem, r, C: gl.constexpr, layout: gl.constexpr):
    """Rank ``r``'s rows of psiv, weighted (the update's B) and plain (raw_y's B), as bf16 operand rows."""
    psi = psi_smem.index(r).load(gl.SliceLayout(0, layout))[None, :]
    psiv_w_smem.slice(r * C, C).store((v_weighted * psi).to(gl.bfloat16))
    psiv_smem.slice(r * C, C).store((v_rows * psi).to(gl.bfloat16))


@gluon.constexpr_function
def _rank_sum_layout(R, C, block_p, num_warps):
    """[R, C, P tile] reads of dz's scratch: a thread holds all ranks of 4 columns (the rank sum in registers)."""
    col_lanes = block_p // 4
    return gl.BlockedLayout([R, 1, 4], [1, 32 // col_lanes, col_lanes], [1, num_warps, 1], [2, 1, 0])


@gluon.constexpr_function
def _partials_layout(block_p, num_warps):
    """The running [R, P tile] token sums: two columns a thread, a warp's lanes across the columns, the warps down
    the ranks.  The tokens' sums come replicated over the lanes that held the tokens; each thread keeps two of those
    values, not sixteen (with Z the compiler moves them through a small shared scratch, which ``shared_bytes``
    counts)."""
    col_lanes = min(32, block_p // 2)
    return gl.BlockedLayout([1, 2], [32 // col_lanes, col_lanes], [num_warps, 1], [1, 0])


@gluon.jit
def _gate_loads(dout_ptr, z_ptr, v_ptr, at, offs, HAS_Z: gl.constexpr, HAS_D: gl.constexpr):
    """The chunk's [C, P tile] rows of dout, z (with Z) and v (with D), as stored; absent ones stand in as dout."""
    dout = gl.load(dout_ptr + at + offs)
    z = gl.load(z_ptr + at + offs) if HAS_Z else dout
    v = gl.load(v_ptr + at + offs) if HAS_D else dout
    return dout, z, v


@gluon.jit
def _head_tile(h, p0, R: gl.constexpr, P: gl.constexpr, BLOCK_P: gl.constexpr, num_warps: gl.constexpr):
    """Offsets of the head's [R, P tile] tile of an [H, R, P] tensor (Phi, Zeta, Psi)."""
    tile_regs: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
    head_r = gl.arange(0, R, gl.SliceLayout(1, tile_regs))
    head_p = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, tile_regs))
    return (h * R + head_r)[:, None] * P + head_p[None, :]


@gluon.jit
def _with_d_skip(y, v, d_psi_smem):
    """raw_y viewed as [R, C, P tile] plus the D skip D Psi[r] v[t] in fp32 (v: the chunk's [C, P tile] rows)."""
    rank_layout: gl.constexpr = gl.SliceLayout(1, y.type.layout)
    return y + gl.expand_dims(d_psi_smem.load(rank_layout), 1) * gl.expand_dims(v.to(gl.float32), 0)


@gluon.jit
def _gate_step(raw_y, dphi_acc, dzeta_acc, dout, z, v, phi_smem, zeta_smem, d_psi_smem, dz_smem, dz_ptr, at, H, P,
               C: gl.constexpr, R: gl.constexpr, BLOCK_P: gl.constexpr, HAS_Z: gl.constexpr, HAS_D: gl.constexpr,
               num_warps: gl.constexpr):
    """gate_grads' math on the chunk's raw_y while it is in registers: the D skip in fp32, the running [R, P tile]
    token sums of dPhi and of dZeta / Phi, and dz (its rank sum through ``dz_smem``) stored for the chunk.

    raw_y [rows, P tile] is viewed as [R, C, P tile] (rank-major rows): a rank's tokens lie in one warp (in two at
    C = 32), so the token sums stay in the warp, and the [C, P tile] rows of dout / z / v broadcast over ranks."""
    y = gl.reshape(raw_y, [R, C, BLOCK_P])
    rank_layout: gl.constexpr = gl.SliceLayout(1, y.type.layout)
    partials_layout: gl.constexpr = dphi_acc.type.layout
    if HAS_D:
        y = _with_d_skip(y, v, d_psi_smem)
    y_dout = y * gl.expand_dims(dout.to(gl.float32), 0)
    if HAS_Z:
        z_rows = gl.expand_dims(z.to(gl.float32), 0)
        zeta = gl.expand_dims(zeta_smem.load(rank_layout), 1)
        gate, dgate = silu_and_grad(z_rows * zeta, True, False)
        dphi_acc += gl.convert_layout(gl.sum(gate * y_dout, axis=1), partials_layout)
        du_over_phi = y_dout * dgate  # dL/du without its Phi factor, which is constant over tokens
        dzeta_acc += gl.convert_layout(gl.sum(du_over_phi * z_rows, axis=1), partials_layout)
        # dz sums over ranks, which lie in different warps: through shared memory, a thread then holding every rank
        # of its columns.
        dz_smem.store(du_over_phi * (gl.expand_dims(phi_smem.load(rank_layout), 1) * zeta))
        sum_layout: gl.constexpr = _rank_sum_layout(R, C, BLOCK_P, num_warps)
        dz = gl.sum(dz_smem.load(sum_layout), axis=0)
        tok_layout: gl.constexpr = gl.SliceLayout(0, sum_layout)
        t = gl.arange(0, C, gl.SliceLayout(1, tok_layout))
        p = gl.arange(0, BLOCK_P, gl.SliceLayout(0, tok_layout))
        gl.store(dz_ptr + at + (t[:, None] * (H * P) + p[None, :]), dz.to(dz_ptr.dtype.element_ty))
    else:
        dphi_acc += gl.convert_layout(gl.sum(y_dout, axis=1), partials_layout)
    return dphi_acc, dzeta_acc


@gluon.jit
def _consumer(q_lo_bufs, q_hi_bufs, k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs, ready, empty,
              q_ready, q_empty,
              qa_lo, qa_hi, ka_lo, ka_hi, weighed_smem, psiv_w_smem, psiv_smem, out_lo_smem, out_hi_smem,
              q_bias_lo, q_bias_hi, k_bias_lo, k_bias_hi, psi_smem, states_desc,
              da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, seg_state_ptr, raw_y_ptr, raw_y_scale_ptr, qk_dot_ptr,
              dout_ptr, z_ptr, v_ptr, dz_ptr, dphi_ptr, dzeta_ptr, phi_smem, zeta_smem, d_psi_smem, dz_smem,
              b, h, H, bh, c_first, p0, pid_p, S, NCH, CHUNKS_PER_SEG, N_SEGMENTS, seg, n_steps,
              C: gl.constexpr, R: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr,
              BLOCK_P: gl.constexpr, BLOCK_SEG_CHUNKS: gl.constexpr, HALF_ROTATION: gl.constexpr,
              TABLE_DTYPE: gl.constexpr, SCALED_RAW_Y: gl.constexpr, Q_IN_PLACE: gl.constexpr,
              WEIGHED_BUFFER: gl.constexpr, RING_WEIGHTS: gl.constexpr, GATE: gl.constexpr, HAS_Z: gl.constexpr,
              HAS_D: gl.constexpr, WEIGHTS_AHEAD: gl.constexpr, TOKEN_WEIGHTS: gl.constexpr, num_warps: gl.constexpr):
    HALF: gl.constexpr = N // 2
    # N = 64: the state is one [64, P tile] accumulator and q~ / k~ one [rows, 64] operand each ([lo | hi]), so a
    # chunk takes three wgmma where N = 128 takes six, plus raw_y's.
    STACKED: gl.constexpr = HALF < _OPERAND_COLS
    gl.static_assert(not (STACKED and Q_IN_PLACE), "q rotated in place needs one operand per N/2 half (N = 128)")
    ROTATION_DTYPE: gl.constexpr = gl.bfloat16 if HALF_ROTATION else gl.float32
    NUM_BUFFERS: gl.constexpr = k_lo_bufs.type.shape[0]
    NUM_Q_BUFFERS: gl.constexpr = q_lo_bufs.type.shape[0]
    P_TILES: gl.constexpr = P // BLOCK_P
    x_layout: gl.constexpr = half_rows_layout(HALF, num_warps)
    p_layout: gl.constexpr = _rows_layout(BLOCK_P, num_warps)
    token_layout: gl.constexpr = gl.SliceLayout(1, p_layout)
    acc_layout: gl.constexpr = _state_layout(BLOCK_P, num_warps)  # states, q~ @ state and raw_y: [64, P tile]
    score_layout: gl.constexpr = _state_layout(_ROWS, num_warps)  # [rows, rows]

    rotated = (gl.arange(0, HALF, gl.SliceLayout(0, x_layout)) < RD)[None, :]
    state_lo, state_hi = entering_segment_state(seg_state_ptr, da_cs_ptr, bh, 0, p0, seg, S, CHUNKS_PER_SEG,
                                                N_SEGMENTS, C, N, P, BLOCK_P, BLOCK_SEG_CHUNKS, STACKED, True,
                                                acc_layout, num_warps)
    token = gl.arange(0, C, token_layout)
    # Rows (r, t) of the scores and of raw_y, rank-major as the boxes land; columns (r', s) of the scores.
    score_row = gl.arange(0, _ROWS, gl.SliceLayout(1, score_layout))
    score_col = gl.arange(0, _ROWS, gl.SliceLayout(0, score_layout))
    y_row = gl.arange(0, _ROWS, gl.SliceLayout(1, acc_layout))
    y_col = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, acc_layout))
    all_rows = score_row < _ROWS
    all_cols = score_col < _ROWS
    bh64 = bh.to(gl.int64)
    if GATE or HAS_D:
        # The chunk's dout / z / v rows [C, P tile] in the layout of raw_y viewed as [R, C, P tile], without its
        # ranks; with the gate its running token sums, [R, P tile] in that view's layout summed over tokens.
        y_view = gl.reshape(gl.zeros([_ROWS, BLOCK_P], gl.float32, acc_layout), [R, C, BLOCK_P])
        if GATE:
            partials_layout: gl.constexpr = _partials_layout(BLOCK_P, num_warps)
            dphi_acc = gl.zeros([R, BLOCK_P], gl.float32, partials_layout)
            dzeta_acc = dphi_acc
        rows_layout: gl.constexpr = gl.SliceLayout(0, y_view.type.layout)
        gate_t = gl.arange(0, C, gl.SliceLayout(1, rows_layout))
        gate_p = gl.arange(0, BLOCK_P, gl.SliceLayout(0, rows_layout))
        gate_offs = gate_t[:, None] * (H * P) + gate_p[None, :]
        act_first = (b.to(gl.int64) * S * H + h) * P + p0  # [B, S, H, P] activations at token 0, column p0
    if TOKEN_WEIGHTS:
        # The intra-chunk weights depend on the tokens (t, s) of a score's row and column only.  Over the scores
        # viewed as [rows, R, C] (the columns' ranks apart: the same registers relabeled) they are computed once a
        # (row, s) and broadcast over the column ranks, where [rows, rows] took an exp for every rank copy.
        pair_layout: gl.constexpr = gl.SliceLayout(
            1, gl.reshape(gl.zeros([_ROWS, _ROWS], gl.float32, score_layout), [_ROWS, R, C]).type.layout)
        pair_row = gl.arange(0, _ROWS, gl.SliceLayout(1, pair_layout))
        pair_col = gl.arange(0, C, gl.SliceLayout(0, pair_layout))
    if WEIGHTS_AHEAD:
        # The weights whose first use is an exp early in the step, loaded a step ahead: asked for at the top of their
        # own step, the exp waits out their L2 latency (~15% of the step's stall samples, docs/optimization.md
        # section 58).  The registers they hold across the step spill at some shapes: the dispatcher says where.
        ahead = bh * S + c_first * C
        log_decay = gl.load(da_cs_ptr + ahead + C - 1)
        y_log_decay = gl.load(da_cs_ptr + ahead + y_row % C)
        if not RING_WEIGHTS:
            da_rev = gl.load(da_rev_ptr + ahead + token)
            trap_scale = gl.load(trap_scale_ptr + ahead + token)
    for i in range(n_steps):
        stage = i % NUM_BUFFERS
        t0 = (c_first + i) * C
        disc = bh * S + t0
        if WEIGHTS_AHEAD:
            decay = gl.exp(log_decay)
            y_decay = gl.exp(y_log_decay)
            if not RING_WEIGHTS:
                psiv_weight = gl.exp(da_rev) * trap_scale  # before da_rev and trap_scale turn to the next step's
            # The next step's (this one's again on the last step, where no next chunk is in range).
            ahead = bh * S + (c_first + gl.minimum(i + 1, n_steps - 1)) * C
            log_decay = gl.load(da_cs_ptr + ahead + C - 1)
            y_log_decay = gl.load(da_cs_ptr + ahead + y_row % C)
            if not RING_WEIGHTS:
                da_rev = gl.load(da_rev_ptr + ahead + token)
                trap_scale = gl.load(trap_scale_ptr + ahead + token)
        else:
            # The chunk's weights asked for before the wait on its tiles (da_rev and trap_scale from the stage with
            # RING_WEIGHTS).
            if not RING_WEIGHTS:
                da_rev = gl.load(da_rev_ptr + disc + token)
                trap_scale = gl.load(trap_scale_ptr + disc + token)
            decay = gl.exp(gl.load(da_cs_ptr + disc + C - 1))
        # The rest of the chunk's weights are first used after the step's first products.
        if TOKEN_WEIGHTS:
            da_row = gl.load(da_cs_ptr + disc + pair_row % C)
            da_col = gl.load(da_cs_ptr + disc + pair_col)
            gamma_row = gl.load(gamma_ptr + disc + pair_row % C)
            ts_col = gl.load(trap_scale_ptr + disc + pair_col)
        else:
            da_row = gl.load(da_cs_ptr + disc + score_row % C)
            da_col = gl.load(da_cs_ptr + disc + score_col % C)
            gamma_row = gl.load(gamma_ptr + disc + score_row % C)
            ts_col = gl.load(trap_scale_ptr + disc + score_col % C)
        if not WEIGHTS_AHEAD:
            y_decay = gl.exp(gl.load(da_cs_ptr + disc + y_row % C))

        mbarrier.wait(ready.index(stage), (i // NUM_BUFFERS) & 1)
        if RING_WEIGHTS and WEIGHTS_AHEAD:
            psiv_weight = (gl.exp(weight_bufs.index(2 * stage).load(token_layout))
                           * weight_bufs.index(2 * stage + 1).load(token_layout))
        elif RING_WEIGHTS:
            da_rev = weight_bufs.index(2 * stage).load(token_layout)
            trap_scale = weight_bufs.index(2 * stage + 1).load(token_layout)
        if TABLE_DTYPE is None:
            cos = gl.where(rotated, cos_bufs.index(stage).load(x_layout).to(ROTATION_DTYPE), 1.0)
            sin = gl.where(rotated, sin_bufs.index(stage).load(x_layout).to(ROTATION_DTYPE), 0.0)
        else:
            cos, sin = table_cos_sin(cos_bufs.index(stage).load(x_layout), TABLE_DTYPE, True)
            cos = gl.where(rotated, cos.to(ROTATION_DTYPE), 1.0)
            sin = gl.where(rotated, sin.to(ROTATION_DTYPE), 0.0)
        v_rows = v_bufs.index(stage).load(p_layout).to(gl.float32)
        if WEIGHTS_AHEAD:
            v_weighted = v_rows * psiv_weight[:, None]
        else:
            v_weighted = v_rows * (gl.exp(da_rev) * trap_scale)[:, None]
        k_lo_rows = k_lo_bufs.index(stage).reshape([_ROWS, HALF])
        k_hi_rows = k_hi_bufs.index(stage).reshape([_ROWS, HALF])
        if Q_IN_PLACE:
            q_stage = i % NUM_Q_BUFFERS
            q_lo_rows = q_lo_bufs.index(q_stage).reshape([_ROWS, HALF])
            q_hi_rows = q_hi_bufs.index(q_stage).reshape([_ROWS, HALF])
            for r in gl.static_range(R):
                _rotate_into(k_lo_rows, k_hi_rows, k_bias_lo, k_bias_hi, cos, sin, ka_lo, ka_hi, r, C, x_layout,
                             ROTATION_DTYPE)
                _weigh_psiv(v_rows, v_weighted, psi_smem, psiv_w_smem, psiv_smem, r, C, p_layout)
            # k's stage is free once k~ and psiv are written: the next chunk's k, angles and v load during this step.
            fence_async_shared()
            mbarrier.arrive(empty.index(stage), count=1)
            mbarrier.wait(q_ready.index(q_stage), (i // NUM_Q_BUFFERS) & 1)
            # q~ where q landed: each thread writes back the elements it read (one layout both ways), and the
            # [R, C, 64] box's 128-byte swizzle is the [R * C, 64] operand's (C a multiple of 8).
            for r in gl.static_range(R):
                _rotate_into(q_lo_rows, q_hi_rows, q_bias_lo, q_bias_hi, cos, sin, q_lo_rows, q_hi_rows, r, C,
                             x_layout, ROTATION_DTYPE)
            fence_async_shared()
            q_op_lo = q_lo_rows
            q_op_hi = q_hi_rows
        else:
            q_lo_rows = q_lo_bufs.index(stage).reshape([_ROWS, HALF])
            q_hi_rows = q_hi_bufs.index(stage).reshape([_ROWS, HALF])
            for r in gl.static_range(R):
                _rotate_into(k_lo_rows, k_hi_rows, k_bias_lo, k_bias_hi, cos, sin, ka_lo, ka_hi, r, C, x_layout,
                             ROTATION_DTYPE, STACKED)
                _rotate_into(q_lo_rows, q_hi_rows, q_bias_lo, q_bias_hi, cos, sin, qa_lo, qa_hi, r, C, x_layout,
                             ROTATION_DTYPE, STACKED)
                _weigh_psiv(v_rows, v_weighted, psi_smem, psiv_w_smem, psiv_smem, r, C, p_layout)
            fence_async_shared()
            mbarrier.arrive(empty.index(stage), count=1)
            q_op_lo = qa_lo
            q_op_hi = qa_hi

        # The entering state leaves by TMA from out_lo / out_hi, which are also q~ @ state_in's B operand.
        _store_entering_state(i, state_lo, state_hi, out_lo_smem, out_hi_smem, states_desc,
                              (bh * NCH + c_first + i) * N, p0, HALF, STACKED)
        out_lo = out_lo_smem.index(0)
        out_hi = out_hi_smem.index(0)
        scores = warpgroup_mma(q_op_lo, ka_lo.permute((1, 0)), gl.zeros([_ROWS, _ROWS], gl.float32, score_layout),
                               is_async=True)
        if not STACKED:
            scores = warpgroup_mma(q_op_hi, ka_hi.permute((1, 0)), scores, is_async=True)
        y_state = warpgroup_mma(q_op_lo, out_lo, gl.zeros([_ROWS, BLOCK_P], gl.float32, acc_layout), is_async=True)
        if not STACKED:
            y_state = warpgroup_mma(q_op_hi, out_hi, y_state, is_async=True)
        state_lo = warpgroup_mma(ka_lo.permute((1, 0)), psiv_w_smem, state_lo * decay, is_async=True)
        # The update's products stay in flight while the scores are weighed.
        if STACKED:
            scores, y_state = warpgroup_mma_wait(1, deps=(scores, y_state))
        else:
            state_hi = warpgroup_mma(ka_hi.permute((1, 0)), psiv_w_smem, state_hi * decay, is_async=True)
            scores, y_state = warpgroup_mma_wait(2, deps=(scores, y_state))
        if Q_IN_PLACE and WEIGHED_BUFFER:
            # q~'s products are done and the weighed scores have a buffer of their own: q's stage is free.
            mbarrier.arrive(q_empty.index(q_stage), count=1)

        if TOKEN_WEIGHTS:
            pair_weights = intra_chunk_weights(pair_row % C, pair_col, pair_row < _ROWS, pair_col < C, da_row, da_col,
                                               gamma_row, ts_col)
            weighed_scores = gl.reshape(gl.reshape(scores, [_ROWS, R, C]) * gl.expand_dims(pair_weights, 1),
                                        [_ROWS, _ROWS])
        else:
            weights = intra_chunk_weights(score_row % C, score_col % C, all_rows, all_cols, da_row, da_col, gamma_row,
                                          ts_col)
            weighed_scores = scores * weights
        # Without a buffer of their own, the weighed scores (raw_y's A operand) go over q~'s low operand, which both
        # of its products have read.
        if WEIGHED_BUFFER:
            weighed = weighed_smem
        else:
            weighed = q_op_lo
        weighed.store(weighed_scores.to(gl.bfloat16))
        fence_async_shared()
        raw_y = warpgroup_mma(weighed, psiv_smem, y_decay[:, None] * y_state, is_async=True)
        if pid_p == 0:
            # qk_dot [B, H, S, R, R]: the same-token entries of the scores (the rotation preserves those dots).
            same = (score_row % C)[:, None] == (score_col % C)[None, :]
            qk_offs = ((bh64 * S + t0 + score_row % C) * R + score_row // C)[:, None] * R + (score_col // C)[None, :]
            gl.store(qk_dot_ptr + qk_offs, scores.to(qk_dot_ptr.dtype.element_ty), mask=same)
        if STACKED:
            raw_y, state_lo = warpgroup_mma_wait(0, deps=(raw_y, state_lo))
        else:
            raw_y, state_lo, state_hi = warpgroup_mma_wait(0, deps=(raw_y, state_lo, state_hi))
        if Q_IN_PLACE and not WEIGHED_BUFFER:
            mbarrier.arrive(q_empty.index(q_stage), count=1)

        if GATE:
            act = act_first + t0.to(gl.int64) * (H * P)
            dout, z, v = _gate_loads(dout_ptr, z_ptr, v_ptr, act, gate_offs, HAS_Z, HAS_D)
            dphi_acc, dzeta_acc = _gate_step(raw_y, dphi_acc, dzeta_acc, dout, z, v, phi_smem, zeta_smem, d_psi_smem,
                                             dz_smem, dz_ptr, act, H, P, C, R, BLOCK_P, HAS_Z, HAS_D, num_warps)
        else:
            if HAS_D:
                # The D skip in fp32 before raw_y's fp16 scaling, so gate_grads adds none.
                act = act_first + t0.to(gl.int64) * (H * P)
                v = gl.load(v_ptr + act + gate_offs)
                raw_y = gl.convert_layout(gl.reshape(_with_d_skip(gl.reshape(raw_y, [R, C, BLOCK_P]), v, d_psi_smem),
                                                     [_ROWS, BLOCK_P]), acc_layout)
            # raw_y [B, H, S, R, P]: row (r, t) of the chunk is row (t0 + t) * R + r of the (b, h) sequence.
            seq_rows = (bh64 * S + t0 + y_row % C) * R + y_row // C
            if SCALED_RAW_Y:
                raw_y, row_unscale = fp16_row_scaled(raw_y)
                gl.store(raw_y_scale_ptr + seq_rows * P_TILES + pid_p, row_unscale)
            gl.store(raw_y_ptr + seq_rows[:, None] * P + y_col[None, :], raw_y.to(raw_y_ptr.dtype.element_ty))
    if GATE:
        # The segment's partials [B, H, n_segments, R, P] of dPhi and dZeta (its Phi factor applied once here).
        part_r = gl.arange(0, R, gl.SliceLayout(1, partials_layout))
        part_p = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, partials_layout))
        part = ((bh64 * N_SEGMENTS + seg) * R + part_r)[:, None] * P + part_p[None, :]
        gl.store(dphi_ptr + part, dphi_acc)
        if HAS_Z:
            gl.store(dzeta_ptr + part, dzeta_acc * phi_smem.load(partials_layout))
    tma.store_wait(0)


@gluon.jit
def _scan_outputs_kernel(q_desc, k_desc, cos_desc, sin_desc, v_desc, states_desc, da_cs_ptr, da_rev_ptr, gamma_ptr,
                         trap_scale_ptr, q_bias_ptr, k_bias_ptr, psi_ptr, seg_state_ptr, raw_y_ptr, raw_y_scale_ptr,
                         qk_dot_ptr, dout_ptr, z_ptr, v_ptr, phi_ptr, zeta_ptr, d_ptr, dz_ptr, dphi_ptr, dzeta_ptr,
                         S, H, G, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
                         C: gl.constexpr, R: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr,
                         BLOCK_P: gl.constexpr, NUM_BUFFERS: gl.constexpr, BLOCK_SEG_CHUNKS: gl.constexpr,
                         num_warps: gl.constexpr, HALF_ROTATION: gl.constexpr = False,
                         TABLE_DTYPE: gl.constexpr = None, SCALED_RAW_Y: gl.constexpr = True,
                         Q_IN_PLACE: gl.constexpr = False, WEIGHED_BUFFER: gl.constexpr = False,
                         RING_WEIGHTS: gl.constexpr = False, GATE: gl.constexpr = False, HAS_Z: gl.constexpr = False,
                         HAS_D: gl.constexpr = False, WEIGHTS_AHEAD: gl.constexpr = False,
                         TOKEN_WEIGHTS: gl.constexpr = False):
    """One program scans one segment of one (b, h) for one P tile of the whole state, storing the state entering
    each chunk and the chunk's raw_y (and, in P tile 0, qk_dot).  The segment starts from the earlier segments'
    end states folded (``seg_state``, from the end-state pass; unused with one segment).  With Q_IN_PLACE, q has a
    one-stage ring of its own and is rotated where it lands (no q~ operands: what lets a 64-wide P tile fit); with
    WEIGHED_BUFFER the weighed scores have a buffer of their own, so q's stage is freed before raw_y's product; with
    RING_WEIGHTS the producer copies each chunk's da_rev and trap_scale into the ring beside its tiles; with GATE the
    consumer applies the gate to each chunk's raw_y in registers (dz, and the segment's dPhi / dZeta partials) instead
    of storing it; with HAS_D and not GATE it adds the D skip to raw_y before storing it."""
    HALF: gl.constexpr = N // 2
    STACKED: gl.constexpr = HALF < _OPERAND_COLS  # N = 64: one operand for both halves, one state-store buffer
    pid_p = gl.program_id(0)
    seg = gl.program_id(1)
    bh = gl.program_id(2)
    b = bh // H
    h = bh % H
    g = h // (H // G)
    p0 = pid_p * BLOCK_P
    c_first = seg * CHUNKS_PER_SEG
    n_steps = gl.minimum(CHUNKS_PER_SEG, NCH - c_first)

    x_box: gl.constexpr = [NUM_BUFFERS] + k_desc.block_type.shape
    q_box: gl.constexpr = [1 if Q_IN_PLACE else NUM_BUFFERS] + q_desc.block_type.shape
    q_lo_bufs = gl.allocate_shared_memory(q_desc.dtype, q_box, q_desc.layout)
    q_hi_bufs = gl.allocate_shared_memory(q_desc.dtype, q_box, q_desc.layout)
    k_lo_bufs = gl.allocate_shared_memory(k_desc.dtype, x_box, k_desc.layout)
    k_hi_bufs = gl.allocate_shared_memory(k_desc.dtype, x_box, k_desc.layout)
    cos_bufs = gl.allocate_shared_memory(cos_desc.dtype, [NUM_BUFFERS] + cos_desc.block_type.shape, cos_desc.layout)
    FROM_ANGLES: gl.constexpr = TABLE_DTYPE is not None
    if FROM_ANGLES:
        sin_bufs = cos_bufs
    else:
        sin_bufs = gl.allocate_shared_memory(sin_desc.dtype, [NUM_BUFFERS] + sin_desc.block_type.shape,
                                             sin_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUFFERS] + v_desc.block_type.shape, v_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    if Q_IN_PLACE:
        q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready.index(0), count=1)
        mbarrier.init(q_empty.index(0), count=1)
    else:
        q_ready = ready
        q_empty = empty

    # The products' operands, rows (rank, token): q~ (unless rotated in place) and k~ per N/2 half (both halves in
    # the first where STACKED), the weighted psiv (the update's B) and the plain psiv (raw_y's B).
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, _OPERAND_COLS], gl.bfloat16)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_ROWS, BLOCK_P], gl.bfloat16)
    if Q_IN_PLACE:
        qa_lo = q_lo_bufs  # not used: the consumer takes q~ from q's stage
        qa_hi = q_hi_bufs
    else:
        qa_lo = gl.allocate_shared_memory(gl.bfloat16, [_ROWS, _OPERAND_COLS], x_layout)
        if STACKED:
            qa_hi = qa_lo  # not used
        else:
            qa_hi = gl.allocate_shared_memory(gl.bfloat16, [_ROWS, _OPERAND_COLS], x_layout)
    if WEIGHED_BUFFER:
        weighed_smem = gl.allocate_shared_memory(gl.bfloat16, [_ROWS, _ROWS],
                                                 gl.NVMMASharedLayout.get_default_for([_ROWS, _ROWS], gl.bfloat16))
    else:
        weighed_smem = q_lo_bufs  # not used
    if GATE:
        # k~'s operands as one buffer: once a chunk's products are done it holds dz's [R, C, P tile] fp32 terms
        # (two operands' room also where STACKED uses the first alone).
        ka = gl.allocate_shared_memory(gl.bfloat16, [2, _ROWS, _OPERAND_COLS], x_layout)
        ka_lo = ka.index(0)
        ka_hi = ka.index(1)
        dz_smem = ka._reinterpret(gl.float32, [R, C, BLOCK_P], gl.SwizzledSharedLayout(2, 1, 8, [2, 1, 0]))
    else:
        ka_lo = gl.allocate_shared_memory(gl.bfloat16, [_ROWS, _OPERAND_COLS], x_layout)
        if STACKED:
            ka_hi = ka_lo  # not used
        else:
            ka_hi = gl.allocate_shared_memory(gl.bfloat16, [_ROWS, _OPERAND_COLS], x_layout)
        dz_smem = ka_lo  # not used
    psiv_w_smem = gl.allocate_shared_memory(gl.bfloat16, [_ROWS, BLOCK_P], p_layout)
    psiv_smem = gl.allocate_shared_memory(gl.bfloat16, [_ROWS, BLOCK_P], p_layout)
    store_shape: gl.constexpr = [1] + states_desc.block_type.shape
    out_lo_smem = gl.allocate_shared_memory(states_desc.dtype, store_shape, states_desc.layout)
    if STACKED:
        out_hi_smem = out_lo_smem  # not used: one [64, P tile] box holds the whole state
    else:
        out_hi_smem = gl.allocate_shared_memory(states_desc.dtype, store_shape, states_desc.layout)

    # The head's q / k bias rows and Psi tile, read once into shared memory (rank-1 layouts: a row is one vector).
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    bias_dtype: gl.constexpr = gl.bfloat16 if HALF_ROTATION else gl.float32
    q_bias_lo = gl.allocate_shared_memory(bias_dtype, [R, HALF], plain)
    q_bias_hi = gl.allocate_shared_memory(bias_dtype, [R, HALF], plain)
    k_bias_lo = gl.allocate_shared_memory(bias_dtype, [R, HALF], plain)
    k_bias_hi = gl.allocate_shared_memory(bias_dtype, [R, HALF], plain)
    psi_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_P], plain)
    col = gl.arange(0, HALF, row_layout)
    psi_col = p0 + gl.arange(0, BLOCK_P, row_layout)
    for r in gl.static_range(R):
        bias_row = (h * R + r) * N + col
        q_bias_lo.index(r).store(gl.load(q_bias_ptr + bias_row).to(bias_dtype))
        q_bias_hi.index(r).store(gl.load(q_bias_ptr + HALF + bias_row).to(bias_dtype))
        k_bias_lo.index(r).store(gl.load(k_bias_ptr + bias_row).to(bias_dtype))
        k_bias_hi.index(r).store(gl.load(k_bias_ptr + HALF + bias_row).to(bias_dtype))
        psi_smem.index(r).store(gl.load(psi_ptr + (h * R + r) * P + psi_col))
    if RING_WEIGHTS:
        # Rows 2 * stage (da_rev) and 2 * stage + 1 (trap_scale) of each ring stage; allocated last, so the other
        # buffers keep their offsets.
        weight_bufs = gl.allocate_shared_memory(gl.float32, [2 * NUM_BUFFERS, C], plain)
    else:
        weight_bufs = psi_smem  # not used
    # The head's Phi, Zeta (with Z) and D Psi (with D) tiles [R, P tile], read by the gate (or, D Psi alone, by the
    # D skip added to raw_y) every chunk.
    tile: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    if GATE:
        phi_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_P], tile)
        zeta_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_P], tile) if HAS_Z else phi_smem
        d_psi_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_P], tile) if HAS_D else phi_smem
        head_tile = _head_tile(h, p0, R, P, BLOCK_P, num_warps)
        phi_smem.store(gl.load(phi_ptr + head_tile))
        if HAS_Z:
            zeta_smem.store(gl.load(zeta_ptr + head_tile))
        if HAS_D:
            d_psi_smem.store(gl.load(d_ptr + h) * gl.load(psi_ptr + head_tile))
    elif HAS_D:
        d_psi_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_P], tile)
        d_psi_smem.store(gl.load(d_ptr + h) * gl.load(psi_ptr + _head_tile(h, p0, R, P, BLOCK_P, num_warps)))
        phi_smem = psi_smem  # not used without the gate
        zeta_smem = psi_smem
    else:
        phi_smem = psi_smem  # not used
        zeta_smem = psi_smem
        d_psi_smem = psi_smem

    gl.thread_barrier()  # the rows above are written by other threads than the consumer's readers
    gl.warp_specialize([
        (_consumer, (q_lo_bufs, q_hi_bufs, k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs, ready,
                     empty, q_ready, q_empty, qa_lo, qa_hi, ka_lo, ka_hi, weighed_smem, psiv_w_smem, psiv_smem,
                     out_lo_smem, out_hi_smem,
                     q_bias_lo, q_bias_hi, k_bias_lo, k_bias_hi, psi_smem, states_desc,
                     da_cs_ptr, da_rev_ptr, gamma_ptr, trap_scale_ptr, seg_state_ptr, raw_y_ptr, raw_y_scale_ptr,
                     qk_dot_ptr, dout_ptr, z_ptr, v_ptr, dz_ptr, dphi_ptr, dzeta_ptr, phi_smem, zeta_smem, d_psi_smem,
                     dz_smem, b, h, H, bh, c_first, p0, pid_p, S, NCH, CHUNKS_PER_SEG, N_SEGMENTS, seg, n_steps,
                     C, R, N, P, RD, BLOCK_P, BLOCK_SEG_CHUNKS, HALF_ROTATION, TABLE_DTYPE, SCALED_RAW_Y,
                     Q_IN_PLACE, WEIGHED_BUFFER, RING_WEIGHTS, GATE, HAS_Z, HAS_D, WEIGHTS_AHEAD, TOKEN_WEIGHTS,
                     num_warps)),
        (_producer, (q_desc, k_desc, cos_desc, sin_desc, v_desc, q_lo_bufs, q_hi_bufs, k_lo_bufs, k_hi_bufs,
                     cos_bufs, sin_bufs, v_bufs, weight_bufs, da_rev_ptr, trap_scale_ptr, ready, empty, q_ready,
                     q_empty, b, h, g, bh, c_first * C, p0, S, n_steps, C, N, P, RD, FROM_ANGLES, Q_IN_PLACE,
                     RING_WEIGHTS)),
    ], [1], [PRODUCER_REGISTERS])


def shared_bytes(*, C, R, block_p=32, num_buffers=1, half_rotation=False, q_in_place=False, weighed_buffer=False,
                 ring_weights=False, gate_form=None, N=128, d_skip=False):
    """The kernel's shared memory: the ring's stages (k, with q unless ``q_in_place``, the angles or the two 16-bit
    tables, v), q's own stage where it is rotated in place, the [rows, 64] k~ operands (and q~'s unless in place; one
    each at N = 64, both halves stacked, but k~'s two with the gate), the two psiv, the weighed scores' buffer
    (``weighed_buffer``), the state-store buffers (one at N = 64) and the bias / Psi rows (the bias in the rotation's
    dtype: fp32, or bf16 with ``half_rotation``), and with ``ring_weights`` each stage's da_rev and trap_scale rows,
    and with the gate (``gate_form``, a ``GateForm``) its fp32 [R, P tile] head tiles and, at C > 16, its token sums'
    scratch (its dz scratch is k~'s operands), or with the D skip in raw_y (``d_skip``) the D Psi tile.  The compiler
    adds barriers and alignment (a few hundred bytes)."""
    half = N // 2
    halves = 1 if half < OPERAND_COLS else 2  # operands and state-store buffers a q~, k~ or state
    half_box = ROWS * half * 2  # one N/2 half of q or k for a chunk: [R, C, N/2] bf16
    stage = (2 if q_in_place else 4) * half_box + C * half * 4 + C * block_p * 2
    stage += 2 * C * 4 if ring_weights else 0
    operand = ROWS * OPERAND_COLS * 2
    k_operands = 2 if gate_form else halves
    fixed = (2 * half_box if q_in_place else 0) + ((0 if q_in_place else halves) + k_operands) * operand
    fixed += 2 * ROWS * block_p * 2 + (ROWS * ROWS * 2 if weighed_buffer else 0) + halves * STATE_ROWS * block_p * 2
    fixed += 4 * R * half * (2 if half_rotation else 4) + R * block_p * 4
    if gate_form:
        # The head tiles, and the compiler's scratch for the token sums: where a rank's rows span C / 16 warps each
        # sum's cross-warp scratch, else with Z one [R, P tile] for their change of layout (as compiled; without Z it
        # takes none).
        fixed += (1 + gate_form.has_z + gate_form.has_d) * R * block_p * 4
        fixed += R * block_p * 4 * ((1 + gate_form.has_z) * (C // 16 - 1) if C > 16 else gate_form.has_z)
    elif d_skip:
        fixed += R * block_p * 4
    return fixed + num_buffers * stage


class Plan(NamedTuple):
    """A launch's P tile and shared-memory plan: ring stages, q rotated in place, the weighed scores' own buffer."""
    block_p: int
    num_buffers: int
    q_in_place: bool
    weighed_buffer: bool


def _fits(**layout):
    return shared_bytes(**layout) + 768 <= SMEM_LIMIT  # 768 bytes for what the model leaves out


class GateForm(NamedTuple):
    """The gate in the pass: with Z (the SiLU gate, dz and dZeta) and with D (the skip added in fp32)."""
    has_z: bool
    has_d: bool


@functools.lru_cache(maxsize=None)
def plan(*, C, R, P, half_rotation=False, block_p=None, ring_weights=False, gate_form=None, N=128, d_skip=False):
    """The widest P tile (64, else 32; or ``block_p``) that divides P and fits the 99 KB bound, with its layout, or
    None.  At 32 columns q~ and k~ have operands of their own beside one or two ring stages.  At 64 (one program
    covers P = 64: q and k rotated once, half the steps of two 32-wide tiles) they do not fit at N = 128: q is rotated
    where it lands in a stage of its own, and the weighed scores get a buffer where it fits, so q's stage is freed
    before raw_y's product (with fp32 bias rows or 32-token chunks they take q~'s low operand instead).  At N = 64
    (half the boxes and operands) q~ keeps its operand.  ``ring_weights``: the stages hold the chunk's da_rev and
    trap_scale too; ``gate_form``: the gate in the pass (a ``GateForm``; None where raw_y is stored); ``d_skip``: the D
    skip added to the stored raw_y.  Cached: every call asks it from ``unsupported``, the production path and
    ``scan_outputs``."""
    stacked = N // 2 < OPERAND_COLS
    # At N = 64 a 128-wide tile's accumulators fit the consumer's registers (one [64, P tile] state, not two); not
    # with the gate, whose dz scratch over k~'s operands holds a 64-wide tile's.
    for width in (block_p,) if block_p else (128, 64, 32) if stacked and not gate_form else (64, 32):
        if P % width:
            continue
        in_place = width > 32 and not stacked
        layout = dict(C=C, R=R, block_p=width, half_rotation=half_rotation, q_in_place=in_place,
                      ring_weights=ring_weights, gate_form=gate_form, N=N, d_skip=d_skip)
        weighed = in_place and _fits(**layout, weighed_buffer=True)
        layout.update(weighed_buffer=weighed)
        if _fits(**layout):
            return Plan(width, 2 if _fits(**layout, num_buffers=2) else 1, in_place, weighed)
    return None


def shape_problems(*, S, R, N, P, chunk_size, dtypes, half_rotation=False, block_p=None, ring_weights=False,
                   gate_form=None, d_skip=False):
    """What keeps the kernel from covering this problem: a list of reasons, empty where it does.
    ``dtypes``: (q, k, v, states) and the rotation tables' (or the angles' table dtype)."""
    C = chunk_size
    problems = []
    if N not in NS:
        problems.append(f"N in {NS}, got N={N}")
    if C * R != ROWS or C % 8:
        problems.append(f"C * R = {ROWS} with C a multiple of 8, got C={C}, R={R}")
    elif N in NS and plan(C=C, R=R, P=P, half_rotation=half_rotation, block_p=block_p, ring_weights=ring_weights,
                          gate_form=gate_form, N=N, d_skip=d_skip) is None:
        tiles = block_p or ("32, 64 or 128" if N == 64 and not gate_form else "32 or 64")
        problems.append(f"a P tile of {tiles} dividing P with one ring stage within {SMEM_LIMIT} bytes of shared "
                        f"memory, got P={P}, C={C}, R={R}")
    if S % C:
        problems.append(f"S a multiple of C, got S={S}, C={C}")
    *activations, table_dtype = dtypes
    if set(activations) != {torch.bfloat16} or table_dtype not in (torch.float16, torch.bfloat16):
        problems.append(f"bf16 q, k, v and states with 16-bit tables, got {dtypes}")
    return problems


def _gate_problems(gate):
    """What keeps the gate in the pass from covering ``gate`` (``scan_outputs``' dict): 16-bit dout and z (the
    approximate sigmoid, as ``gluon_gate_grads``), contiguous activations and outputs."""
    problems = []
    for name in ("dout", "z"):
        tensor = gate.get(name)
        if tensor is not None and tensor.dtype not in (torch.float16, torch.bfloat16):
            problems.append(f"16-bit {name} for the gate in the pass, got {tensor.dtype}")
    return problems


def gate_form_of(gate):
    """The ``GateForm`` of ``scan_outputs``' ``gate`` dict (None without one)."""
    return GateForm(has_z=gate.get("z") is not None, has_d=gate.get("d") is not None) if gate else None


def unsupported(*, q, k, v, states, chunk_size, cos_angles=None, sin_angles=None, angles=None, table_dtype=None,
                tensors=(), half_rotation=False, block_p=None, ring_weights=False, gate=None, d=None):
    """None where the kernel covers this call (the scan and output arguments as ``scan_outputs`` takes them), else
    the reason: a Hopper GPU outside the interpreter, contiguous 16-byte aligned tensors (``tensors`` names more to
    check, as do the ``gate`` dict's), and ``shape_problems``."""
    if not q.is_cuda or knobs.runtime.interpret or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "needs a Hopper GPU (wgmma, TMA) outside the Triton interpreter"
    trig = rotation_source("gluon_scan_outputs", k, cos_angles, sin_angles, angles, table_dtype)
    named = dict(q=q, k=k, v=v, states=states, cos_angles=trig["cos_angles"], sin_angles=trig["sin_angles"],
                 **dict(tensors), **(gate or {}))
    for name, tensor in named.items():
        if tensor is not None and (not tensor.is_contiguous() or tensor.data_ptr() % 16):
            return f"needs {name} contiguous and 16-byte aligned"
    _, S, R, _, N = q.shape
    problems = shape_problems(S=S, R=R, N=N, P=v.shape[3], chunk_size=chunk_size,
                              dtypes=(q.dtype, k.dtype, v.dtype, states.dtype, trig["table_dtype"]),
                              half_rotation=half_rotation, block_p=block_p, ring_weights=ring_weights,
                              gate_form=gate_form_of(gate), d_skip=d is not None and not gate)
    problems += _gate_problems(gate or {})
    if (v.shape[2] * trig["RD"] * 2) % 16:
        problems.append(f"16-byte rows of the cos / sin tables, got H * RD = {v.shape[2] * trig['RD']}")
    return "; ".join(problems) or None


def scan_outputs(*, q, k, v, q_bias, k_bias, mimo_v, da_cs, da_cs_rev, gamma, trap_scale, states, seg_state, qk_dot,
                 raw_y, raw_y_scale, chunk_size, n_segments, chunks_per_segment, cos_angles=None, sin_angles=None,
                 angles=None, table_dtype=None, half_rotation=False, block_p=None, ring_weights=False, gate=None,
                 d=None, weights_ahead=False, token_weights=False, **_unused):
    """The storing scan pass with chunk_scan's products (``gluon_chunk_states`` plus ``chunk_scan`` without the D
    skip), through one kernel.

    q, k [B, S, R, G, N] bf16, v [B, S, H, P] bf16; q_bias / k_bias [H, R, N] fp32, mimo_v [H, R, P] fp32;
    da_cs / da_cs_rev / gamma / trap_scale [B, H, S] fp32 (chunk-local cumsums, ``token_tables``' weights); the
    cos / sin tables [B, S, H, RD] (16-bit), or ``angles`` [B, S, H, RD] fp32 with the ``table_dtype`` they stand for;
    seg_state [B, H, n_segments, N, P] fp32 end states of ``gluon_segment_end_states`` (None with one segment).
    Writes states [B, H, nch, N, P] bf16, qk_dot [B, H, S, R, R], raw_y [B, H, S, R, P] (fp16 with raw_y_scale
    [B, H, S, R, P / block_p] fp32, the factor undoing each row's power of two, or fp32 with raw_y_scale None).
    ``half_rotation``: q's and k's bias add and rotation in bf16.  ``block_p``: the P tile (None: ``plan``'s, the
    widest that fits; raw_y_scale has a column per tile).  ``ring_weights``: each chunk's da_rev and trap_scale reach
    the consumer through the ring (copied by the producer) rather than by its own loads.  ``d`` [H] fp32: the D skip
    added to raw_y in fp32 before it is stored (else left to ``gate_grads``; with ``gate`` it is the gate's d).
    ``weights_ahead``: the chunk's log decays (and without the ring its da_rev and trap_scale) are loaded a step ahead.
    ``token_weights``: the intra-chunk weights computed once a (row, column token) and broadcast over the column ranks.

    ``gate``: the gate applied in the pass, so no raw_y goes out (raw_y and raw_y_scale None): a dict of dout, z (or
    None) [B, S, H, P] 16-bit, mimo_o, mimo_z (or None) [H, R, P] fp32, d [H] fp32 (or None: no D skip; with the
    gate the skip is added here, in fp32), and the outputs dz [B, S, H, P] (None without z) and dphi, dzeta (None
    without z) [B, H, n_segments, R, P] fp32, the segments' partials of dPhi and dZeta for ``sum_group_partials``."""
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    trig = rotation_source("gluon_scan_outputs", k, cos_angles, sin_angles, angles, table_dtype)
    if gate and d is not None:
        raise ValueError("gluon_scan_outputs: with the gate in the pass the D skip is the gate's d")
    d_skip = d is not None
    problems = shape_problems(S=S, R=R, N=N, P=P, chunk_size=chunk_size,
                              dtypes=(q.dtype, k.dtype, v.dtype, states.dtype, trig["table_dtype"]),
                              half_rotation=half_rotation, block_p=block_p, ring_weights=ring_weights,
                              gate_form=gate_form_of(gate), d_skip=d_skip)
    problems += _gate_problems(gate or {})
    if problems:
        raise ValueError("gluon_scan_outputs: needs " + "; ".join(problems))
    layout = plan(C=chunk_size, R=R, P=P, half_rotation=half_rotation, block_p=block_p, ring_weights=ring_weights,
                  gate_form=gate_form_of(gate), N=N, d_skip=d_skip)
    if gate and (raw_y is not None or raw_y_scale is not None):
        raise ValueError("gluon_scan_outputs: with the gate in the pass there is no raw_y scratch")
    if gate and gate["dphi"].shape != (B, H, n_segments, R, P):
        raise ValueError(f"gluon_scan_outputs: dphi needs {(B, H, n_segments, R, P)}, got {tuple(gate['dphi'].shape)}")
    if raw_y_scale is not None and raw_y_scale.shape[-1] != P // layout.block_p:
        raise ValueError(f"gluon_scan_outputs: raw_y_scale needs {P // layout.block_p} columns (P tiles of "
                         f"{layout.block_p}), got {raw_y_scale.shape[-1]}")
    found = descriptors(k=k, v=v, cos_angles=cos_angles, sin_angles=sin_angles, states=states,
                        chunk_size=chunk_size, block_p=layout.block_p, angles=angles, q=q)
    launch(_scan_outputs_kernel, (P // layout.block_p, n_segments, B * H),
           *(found[name] for name in ("q_desc", "k_desc", "cos_desc", "sin_desc", "v_desc", "states_desc")),
           da_cs, da_cs_rev, gamma, trap_scale, q_bias, k_bias, mimo_v,
           trap_scale if seg_state is None else seg_state, *_output_args(raw_y, raw_y_scale, qk_dot, gate, v, d),
           S, H, G, cdiv(S, chunk_size), chunks_per_segment, n_segments,
           C=chunk_size, R=R, N=N, P=P, RD=trig["RD"], BLOCK_P=layout.block_p, NUM_BUFFERS=layout.num_buffers,
           BLOCK_SEG_CHUNKS=triton.next_power_of_2(chunks_per_segment), num_warps=4, maxnreg=MAX_REGISTERS,
           HALF_ROTATION=half_rotation, SCALED_RAW_Y=raw_y_scale is not None,
           **({"TABLE_DTYPE": trig["TABLE_DTYPE"]} if trig["FROM_ANGLES"] else {}),
           **({"Q_IN_PLACE": True, "WEIGHED_BUFFER": layout.weighed_buffer} if layout.q_in_place else {}),
           **({"RING_WEIGHTS": True} if ring_weights else {}),
           **({"WEIGHTS_AHEAD": True} if weights_ahead else {}),
           **({"TOKEN_WEIGHTS": True} if token_weights else {}),
           **(dict(GATE=True, HAS_Z=gate["z"] is not None, HAS_D=gate["d"] is not None) if gate else {}),
           **({"HAS_D": True} if d_skip else {}))


def _output_args(raw_y, raw_y_scale, qk_dot, gate, v, d):
    """The kernel's arguments from raw_y_ptr to dzeta_ptr; the unused ones stand in as qk_dot (GATE off, or Z / D
    off within the gate); without the gate, v and d where the D skip goes into raw_y (``d``)."""
    if not gate:
        skip = (qk_dot,) * 4 if d is None else (v, qk_dot, qk_dot, d)
        return (raw_y, raw_y if raw_y_scale is None else raw_y_scale, qk_dot, qk_dot, qk_dot) + skip + (qk_dot,) * 3
    stand_in = gate["dout"]
    args = dict(dout=gate["dout"], z=gate["z"], v=v, phi=gate["mimo_o"], zeta=gate["mimo_z"], d=gate["d"],
                dz=gate["dz"], dphi=gate["dphi"], dzeta=gate["dzeta"])
    return (qk_dot, qk_dot, qk_dot) + tuple(stand_in if value is None else value for value in args.values())
