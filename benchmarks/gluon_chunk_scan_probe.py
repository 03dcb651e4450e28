"""A first Gluon form of chunk_scan (the output stage's raw_y): compiled, emulated, not run on a GPU yet.

    python benchmarks/gluon_chunk_scan_probe.py --compile-only   # no GPU: compiled for sm_90, resources and SASS
    python benchmarks/gluon_chunk_scan_probe.py --emulate        # no GPU: its programs replayed in torch against
                                                                 # the production chunk_scan (interpreter)

Not in the package and never run on a GPU (written in the twenty-fifth session after its device time was spent):
the next device session's candidate for docs/optimization.md section 34's plan.  What it computes is
``chunk_scan(raw_y=...)`` of ``mamba3_mimo/ops/chunk_scan.py``: per (P tile, chunk or span of chunks, (b, h)),

    scores = q~ k~^T                                       [R * C, R * C], rows (rank, token): rank-major here
    raw_y  = (scores * W) psiv + exp(da_cs) (q~ state_in) + D psiv          [R * C, P tile]

with the same-token blocks of the scores stored as qk_dot by the first P tile, and raw_y stored as fp16 scaled by
a power of two per row (``fp16_row_scaled``) with its inverse in raw_y_scale, as gate_grads reads them.

One program, one warpgroup, no producer partition: the chunks are independent, so every box of a program is asked
for at once on one mbarrier (q and k as [R, C, 64] boxes of [R, B * S, G * N] views, rank-major as in the Gluon state
scan; cos / sin [C, 64]; v [C, P tile]; the entering state as [64, P tile] bf16 boxes, the B operand of q~ @ state
as they land), and the programs resident on an SM hide each other's loads.  q and k are rotated in place in shared
memory; three wgmma chains: scores (K = N), q~ @ state (K = N), then the weighted scores as bf16 times psiv.
With the local-state schedule's entry states (``seg_entry``, one chunk a program) it also adds them to the state
boxes and writes the full states back, as chunk_scan does.  Scope: N = 64 (32-wide pieces) or a multiple of 128
within 99 KB (not N = 256: 122 KB), R * C * span_chunks = 64 (wgmma's M for one warpgroup: R4_C16, R8_C8, R2_C32,
R1_C64 one chunk a program, N128_P128_R4_C8 in spans of two as its dispatcher config has them), a P tile of 32 or
64, S a multiple of the span, bf16 q / k / v / states, 16-bit tables.
"""

import argparse
import contextlib
import itertools
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mamba3_mimo.ops.gluon_state_scan import _rows_layout, _state_layout  # noqa: E402  (shared layouts)
from mamba3_mimo.ops.host_utils import cdiv  # noqa: E402
from mamba3_mimo.ops.launch import launch  # noqa: E402

# dtypes of the entering states the kernel's boxes take (the CPU wiring test adds fp32, which the interpreter path's
# state hand-off is, for ``emulate``).
STATES_DTYPES = (torch.bfloat16,)
PIECE = 64  # columns of a q / k / cos / sin box and rows of a state box: one 128-byte swizzled bf16 row (32 at N = 64)


def piece_width(N):
    """Columns of a q / k / cos / sin box and rows of a state box: 64, or N / 2 = 32 at N = 64."""
    return min(PIECE, N // 2)
ROWS = 64  # (rank, token) rows of a program: wgmma's M for one warpgroup
SMEM_LIMIT = 101_376  # the project's per-launch bound (99 KB)


@gluon.jit
def _rotate_in_place(bufs, cos_bufs, sin_bufs, bias_ptr, h, RD, C: gl.constexpr, R: gl.constexpr,
                     N: gl.constexpr, num_warps: gl.constexpr):
    """q or k + its bias, rotated by the tokens' angles, written back over the boxes as bf16.  ``bufs`` [2 * pieces,
    R, C, width]: the lo half's pieces, then the hi half's (piece j of each half pairs with the other's)."""
    HALF: gl.constexpr = N // 2
    WIDTH: gl.constexpr = bufs.type.shape[3]  # 64, or 32 at N = 64
    PIECES: gl.constexpr = HALF // WIDTH
    if WIDTH < 64:
        # 4 columns (8 bytes) a thread, as the Gluon state scan's 32-wide tiles.
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    else:
        layout: gl.constexpr = _rows_layout(WIDTH, num_warps)
    col = gl.arange(0, WIDTH, gl.SliceLayout(0, layout))
    for j in gl.static_range(PIECES):
        rotated = (j * WIDTH + col < RD)[None, :]
        cos = gl.where(rotated, cos_bufs.index(j).load(layout).to(gl.float32), 1.0)
        sin = gl.where(rotated, sin_bufs.index(j).load(layout).to(gl.float32), 0.0)
        lo_rows = bufs.index(j).reshape([R * C, WIDTH])
        hi_rows = bufs.index(PIECES + j).reshape([R * C, WIDTH])
        for r in gl.static_range(R):
            bias = bias_ptr + (h * R + r) * N + j * WIDTH + col
            x_lo = lo_rows.slice(r * C, C).load(layout).to(gl.float32) + gl.load(bias)[None, :]
            x_hi = hi_rows.slice(r * C, C).load(layout).to(gl.float32) + gl.load(bias + HALF)[None, :]
            # Each thread writes back the elements it read (one layout both ways): in place is safe.
            lo_rows.slice(r * C, C).store((cos * x_lo - sin * x_hi).to(gl.bfloat16))
            hi_rows.slice(r * C, C).store((sin * x_lo + cos * x_hi).to(gl.bfloat16))


@gluon.jit
def _span_da_cs(da_cs_ptr, disc, t, C: gl.constexpr, SPAN: gl.constexpr):
    """da_cs at the span's tokens ``t`` re-based to the span's start (da_cs restarts every chunk): the log decays
    of the span's earlier chunks added (``triton_utils.span_decay_offsets``)."""
    da = gl.load(da_cs_ptr + disc + t)
    for i in gl.static_range(SPAN - 1):
        da += gl.where(t // C > i, gl.load(da_cs_ptr + disc + i * C + C - 1), 0.0)
    return da


@gluon.jit
def _add_segment_entry(state_bufs, states_ptr, seg_entry_ptr, entry_decay_ptr, bh, span, NCH, CHUNKS_PER_SEG,
                       N_SEGMENTS, p0, N: gl.constexpr, P: gl.constexpr, HALF: gl.constexpr, WIDTH: gl.constexpr,
                       PIECES: gl.constexpr, BLOCK_P: gl.constexpr, num_warps: gl.constexpr):
    """Local-state schedule (one chunk a program): the boxes hold the segment-local state; the state entering the
    chunk adds its segment's entry state times its decay from the segment start.  It replaces the boxes (as the B
    operand, bf16 as chunk_scan's dot operand) and the local state in ``states`` (the output)."""
    seg = span // CHUNKS_PER_SEG
    if seg > 0:
        entry_scale = gl.load(entry_decay_ptr + bh * NCH + span)
        fix_layout: gl.constexpr = _rows_layout(BLOCK_P, num_warps)
        n_rows = gl.arange(0, WIDTH, gl.SliceLayout(1, fix_layout))
        p_cols = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, fix_layout))
        for i in gl.static_range(2 * PIECES):
            offs = ((i // PIECES) * HALF + (i % PIECES) * WIDTH + n_rows)[:, None] * P + p_cols[None, :]
            full = state_bufs.index(i).load(fix_layout).to(gl.float32) + entry_scale * gl.load(
                seg_entry_ptr + (bh * N_SEGMENTS + seg) * N * P + offs)
            state_bufs.index(i).store(full.to(gl.bfloat16))
            gl.store(states_ptr + (bh * NCH + span) * N * P + offs, full.to(gl.bfloat16))


@gluon.jit
def _store_psiv(psiv_smem, v_smem, psi_ptr, h, p0, R: gl.constexpr, L: gl.constexpr, P: gl.constexpr,
                BLOCK_P: gl.constexpr, num_warps: gl.constexpr):
    """psiv [R * L, P tile] (rank-major rows) = v * Psi[r] as bf16, the B operand of the mixing product."""
    p_layout: gl.constexpr = _rows_layout(BLOCK_P, num_warps)
    p_cols = gl.arange(0, BLOCK_P, gl.SliceLayout(0, p_layout))
    v_tile = v_smem.load(p_layout).to(gl.float32)
    for r in gl.static_range(R):
        psi = gl.load(psi_ptr + (h * R + r) * P + p0 + p_cols)
        psiv_smem.slice(r * L, L).store((v_tile * psi[None, :]).to(gl.bfloat16))


@gluon.jit
def _gluon_chunk_scan_kernel(q_desc, k_desc, cos_desc, sin_desc, v_desc, states_desc, q_bias_ptr, k_bias_ptr,
                             psi_ptr, d_ptr, v_ptr, da_cs_ptr, gamma_ptr, trap_scale_ptr, qk_dot_ptr, raw_y_ptr,
                             raw_y_scale_ptr, states_ptr, seg_entry_ptr, entry_decay_ptr, S, H, G, NCH, RD,
                             CHUNKS_PER_SEG, N_SEGMENTS,
                             C: gl.constexpr, R: gl.constexpr, N: gl.constexpr, P: gl.constexpr,
                             BLOCK_P: gl.constexpr, SPAN: gl.constexpr, ADD_ENTRY: gl.constexpr, HAS_D: gl.constexpr,
                             SPLIT_LOADS: gl.constexpr, num_warps: gl.constexpr):
    # A span of SPAN chunks (L tokens) is read as one chunk, as chunk_scan's span_chunks: raw_y does not depend on
    # where chunks are cut; the state read is the one entering the span.
    HALF: gl.constexpr = N // 2
    WIDTH: gl.constexpr = q_desc.block_type.shape[2]  # columns of a piece: 64, or 32 at N = 64
    PIECES: gl.constexpr = HALF // WIDTH
    L: gl.constexpr = C * SPAN
    RC: gl.constexpr = R * L
    P_TILES: gl.constexpr = P // BLOCK_P
    pid_p = gl.program_id(0)
    span = gl.program_id(1)
    bh = gl.program_id(2)
    b = bh // H
    h = bh % H
    g = h // (H // G)
    p0 = pid_p * BLOCK_P
    t0 = span * L
    row = b * S + t0

    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 * PIECES] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2 * PIECES] + k_desc.block_type.shape, k_desc.layout)
    cos_bufs = gl.allocate_shared_memory(cos_desc.dtype, [PIECES] + cos_desc.block_type.shape, cos_desc.layout)
    sin_bufs = gl.allocate_shared_memory(sin_desc.dtype, [PIECES] + sin_desc.block_type.shape, sin_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    state_bufs = gl.allocate_shared_memory(states_desc.dtype, [2 * PIECES] + states_desc.block_type.shape,
                                           states_desc.layout)
    psiv_smem = gl.allocate_shared_memory(gl.bfloat16, [RC, BLOCK_P],
                                          gl.NVMMASharedLayout.get_default_for([RC, BLOCK_P], gl.bfloat16))
    mixing_smem = gl.allocate_shared_memory(gl.bfloat16, [RC, RC],
                                            gl.NVMMASharedLayout.get_default_for([RC, RC], gl.bfloat16))
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    qk_bytes: gl.constexpr = 2 * 2 * PIECES * q_desc.block_type.nbytes + 2 * PIECES * cos_desc.block_type.nbytes
    state_v_bytes: gl.constexpr = v_desc.block_type.nbytes + 2 * PIECES * states_desc.block_type.nbytes
    if SPLIT_LOADS:
        # q, k and the tables on one barrier, the state and v on a second: the rotation and the scores start once
        # the first lands, while the state boxes (the most bytes, from DRAM) are still on their way.
        state_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(state_bar, count=1)
        mbarrier.expect(bar, qk_bytes)
        mbarrier.expect(state_bar, state_v_bytes)
    else:
        # Every box of the program on one barrier.
        state_bar = bar
        mbarrier.expect(bar, qk_bytes + state_v_bytes)
    for i in gl.static_range(2 * PIECES):
        column = g * N + (i // PIECES) * HALF + (i % PIECES) * WIDTH
        tma.async_copy_global_to_shared(q_desc, [0, row, column], bar, q_bufs.index(i))
        tma.async_copy_global_to_shared(k_desc, [0, row, column], bar, k_bufs.index(i))
    for j in gl.static_range(PIECES):
        tma.async_copy_global_to_shared(cos_desc, [row, h * RD + j * WIDTH], bar, cos_bufs.index(j))
        tma.async_copy_global_to_shared(sin_desc, [row, h * RD + j * WIDTH], bar, sin_bufs.index(j))
    for i in gl.static_range(2 * PIECES):
        state_row = (bh * NCH + span * SPAN) * N + (i // PIECES) * HALF + (i % PIECES) * WIDTH
        tma.async_copy_global_to_shared(states_desc, [state_row, p0], state_bar, state_bufs.index(i))
    tma.async_copy_global_to_shared(v_desc, [row, h * P + p0], state_bar, v_smem)

    # Per-(rank, token) row and per-column vectors of the [RC, RC] scores and the [RC, P tile] outputs; rows are
    # rank-major, row = r * L + t.
    scores_layout: gl.constexpr = _state_layout(RC, num_warps)
    y_layout: gl.constexpr = _state_layout(BLOCK_P, num_warps)
    rows = gl.arange(0, RC, gl.SliceLayout(1, scores_layout))
    cols = gl.arange(0, RC, gl.SliceLayout(0, scores_layout))
    row_t = rows % L
    col_t = cols % L
    disc = bh * S + t0
    da_row = _span_da_cs(da_cs_ptr, disc, row_t, C, SPAN)
    gamma_row = gl.load(gamma_ptr + disc + row_t)
    da_col = _span_da_cs(da_cs_ptr, disc, col_t, C, SPAN)
    ts_col = gl.load(trap_scale_ptr + disc + col_t)
    earlier = row_t[:, None] > col_t[None, :]
    same = row_t[:, None] == col_t[None, :]
    weights = gl.where(earlier, gl.exp(gl.where(earlier, da_row[:, None] - da_col[None, :], 0.0)) * ts_col[None, :],
                       gl.where(same, gamma_row[:, None], 0.0))

    if SPLIT_LOADS:
        mbarrier.wait(bar, 0)
        _rotate_in_place(q_bufs, cos_bufs, sin_bufs, q_bias_ptr, h, RD, L, R, N, num_warps)
        _rotate_in_place(k_bufs, cos_bufs, sin_bufs, k_bias_ptr, h, RD, L, R, N, num_warps)
        fence_async_shared()
        scores = gl.zeros([RC, RC], gl.float32, scores_layout)
        for i in gl.static_range(2 * PIECES):
            scores = warpgroup_mma(q_bufs.index(i).reshape([RC, WIDTH]),
                                   k_bufs.index(i).reshape([RC, WIDTH]).permute((1, 0)), scores, is_async=True)
        mbarrier.wait(state_bar, 0)
        if ADD_ENTRY:
            _add_segment_entry(state_bufs, states_ptr, seg_entry_ptr, entry_decay_ptr, bh, span, NCH, CHUNKS_PER_SEG,
                               N_SEGMENTS, p0, N, P, HALF, WIDTH, PIECES, BLOCK_P, num_warps)
        _store_psiv(psiv_smem, v_smem, psi_ptr, h, p0, R, L, P, BLOCK_P, num_warps)
        fence_async_shared()
        y_state = gl.zeros([RC, BLOCK_P], gl.float32, y_layout)
        for i in gl.static_range(2 * PIECES):
            y_state = warpgroup_mma(q_bufs.index(i).reshape([RC, WIDTH]), state_bufs.index(i), y_state,
                                    is_async=True)
        scores, y_state = warpgroup_mma_wait(0, deps=(scores, y_state))
        mbarrier.invalidate(bar)
        mbarrier.invalidate(state_bar)
    else:
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        if ADD_ENTRY:
            _add_segment_entry(state_bufs, states_ptr, seg_entry_ptr, entry_decay_ptr, bh, span, NCH, CHUNKS_PER_SEG,
                               N_SEGMENTS, p0, N, P, HALF, WIDTH, PIECES, BLOCK_P, num_warps)
        _rotate_in_place(q_bufs, cos_bufs, sin_bufs, q_bias_ptr, h, RD, L, R, N, num_warps)
        _rotate_in_place(k_bufs, cos_bufs, sin_bufs, k_bias_ptr, h, RD, L, R, N, num_warps)
        _store_psiv(psiv_smem, v_smem, psi_ptr, h, p0, R, L, P, BLOCK_P, num_warps)
        fence_async_shared()

        scores = gl.zeros([RC, RC], gl.float32, scores_layout)
        y_state = gl.zeros([RC, BLOCK_P], gl.float32, y_layout)
        for i in gl.static_range(2 * PIECES):
            q_rows = q_bufs.index(i).reshape([RC, WIDTH])
            scores = warpgroup_mma(q_rows, k_bufs.index(i).reshape([RC, WIDTH]).permute((1, 0)), scores,
                                   is_async=True)
            y_state = warpgroup_mma(q_rows, state_bufs.index(i), y_state, is_async=True)
        scores, y_state = warpgroup_mma_wait(0, deps=(scores, y_state))

    if pid_p == 0:
        # Same-token blocks are qk_dot[t, r, r'] (rotation keeps those dots).
        qk_offs = ((bh * S + t0 + row_t) * R + rows // L)[:, None] * R + (cols // L)[None, :]
        gl.store(qk_dot_ptr + qk_offs, scores.to(qk_dot_ptr.dtype.element_ty), mask=same)
    mixing_smem.store((scores * weights).to(gl.bfloat16))
    fence_async_shared()
    raw_y = warpgroup_mma(mixing_smem, psiv_smem, gl.zeros([RC, BLOCK_P], gl.float32, y_layout), is_async=True)
    raw_y = warpgroup_mma_wait(0, deps=(raw_y,))

    y_rows = gl.arange(0, RC, gl.SliceLayout(1, y_layout))
    y_cols = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, y_layout))
    y_t = y_rows % L
    y_r = y_rows // L
    raw_y += gl.exp(_span_da_cs(da_cs_ptr, disc, y_t, C, SPAN))[:, None] * y_state
    if HAS_D:
        # The D skip in fp32, from v and Psi in the accumulator's layout.
        v_rows = gl.load(v_ptr + ((b * S + t0 + y_t) * H + h)[:, None] * P + y_cols[None, :]).to(gl.float32)
        psi_rows = gl.load(psi_ptr + (h * R + y_r)[:, None] * P + y_cols[None, :])
        raw_y += gl.load(d_ptr + h) * v_rows * psi_rows
    # fp16 scaled by a power of two per row (triton_utils.fp16_row_scaled, which gate_grads undoes).
    exp_bits = gl.max(gl.abs(raw_y), axis=1).to(gl.int32, bitcast=True) & 0x7F800000
    exp_bits = gl.maximum(exp_bits, 27 << 23)
    scale = ((254 << 23) - exp_bits + (14 << 23)).to(gl.float32, bitcast=True)
    unscale = (exp_bits - (14 << 23)).to(gl.float32, bitcast=True)
    seq_rows = (bh * S + t0 + y_t) * R + y_r  # raw_y [B, H, S, R, P] rows (token, rank)
    gl.store(raw_y_ptr + seq_rows[:, None] * P + y_cols[None, :], (raw_y * scale[:, None]).to(gl.float16))
    gl.store(raw_y_scale_ptr + seq_rows * P_TILES + pid_p, unscale)


def shared_bytes(*, N, R, block_p):
    """The probe's shared memory but for its mbarrier (8 bytes): q, k and the entering state in pieces of
    ``piece_width`` columns / rows, the cos / sin pieces of the span's L = 64 / R tokens, v, psiv and the weighted
    scores."""
    width = piece_width(N)
    pieces, tokens = N // width, ROWS // R
    return (2 * pieces * ROWS * width * 2 + pieces * width * block_p * 2 + pieces * tokens * width * 2
            + tokens * block_p * 2 + ROWS * block_p * 2 + ROWS * ROWS * 2)


def shape_problems(*, S, R, N, P, RD, H, chunk_size, block_p, span_chunks=1):
    """What keeps the probe's boxes from covering a problem (empty where they do)."""
    problems = []
    if N % 128 and N != 64:
        problems.append(f"N = 64 or a multiple of 128, got {N}")
    L = chunk_size * span_chunks
    if R * L != ROWS:
        problems.append(f"R * C * span_chunks = {ROWS} rows (one warpgroup's wgmma M), got R={R}, C={chunk_size}, "
                        f"span_chunks={span_chunks}")
    if block_p not in (32, 64) or P % block_p:
        problems.append(f"a P tile of 32 or 64 dividing P, got block_p={block_p}, P={P}")
    if S % L:
        problems.append(f"S a multiple of C * span_chunks, got S={S}")
    # The in-place rotation reads and writes each element from one thread: its layout (4 warps of 4 rows at 32
    # columns, of 1 row at 64) must not repeat rows, or a second reader could see a rotated value.
    if (N == 64 or not N % 128) and L < (16 if piece_width(N) < PIECE else 4):
        problems.append(f"a span of at least {16 if piece_width(N) < PIECE else 4} tokens, got {L}")
    if (N == 64 or not N % 128) and shared_bytes(N=N, R=R, block_p=block_p) + 8 > SMEM_LIMIT:
        problems.append(f"shared memory within 99 KB, got {shared_bytes(N=N, R=R, block_p=block_p) + 8} at N={N}")
    if (H * RD * 2) % 16:
        problems.append(f"16-byte rows of the cos / sin tables, got H * RD = {H * RD}")
    return problems


def descriptors(*, q, k, v, cos_angles, sin_angles, states, chunk_size, block_p, span_chunks=1):
    """The probe's TMA descriptors (host-side); a box holds a span's L = C * span_chunks tokens."""
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    RD = cos_angles.shape[3]
    C, width = chunk_size * span_chunks, piece_width(N)
    states_rows = states.shape[0] * states.shape[1] * states.shape[2] * states.shape[3]

    def box(tensor, shape, strides, block):
        element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[tensor.dtype]
        return TensorDescriptor(tensor, list(shape), list(strides), list(block),
                                gl.NVMMASharedLayout.get_default_for(block, element))

    return dict(
        q_desc=box(q, [R, B * S, G * N], [G * N, R * G * N, 1], [R, C, width]),
        k_desc=box(k, [R, B * S, G * N], [G * N, R * G * N, 1], [R, C, width]),
        cos_desc=box(cos_angles, [B * S, H * RD], [H * RD, 1], [C, width]),
        sin_desc=box(sin_angles, [B * S, H * RD], [H * RD, 1], [C, width]),
        v_desc=box(v, [B * S, H * P], [H * P, 1], [C, block_p]),
        states_desc=box(states, [states_rows, P], [P, 1], [width, block_p]),
    )


def gluon_chunk_scan(*, q, k, v, cos_angles, sin_angles, q_bias, k_bias, mimo_v, d, da_cs, gamma, trap_scale,
                     states, qk_dot, raw_y, raw_y_scale, chunk_size, block_p, span_chunks=1, seg_entry=None,
                     entry_decay=None, chunks_per_segment=1, split_loads=False, **_unused):
    """``chunk_scan(raw_y=..., raw_y_scale=...)`` (fp16 raw_y) through the probe kernel: a program per (P tile, span
    of ``span_chunks`` chunks, (b, h)).  With ``seg_entry`` and ``entry_decay`` (the local-state schedule, one chunk
    a span) ``states`` holds segment-local states on entry and full ones on return, as chunk_scan does.
    ``split_loads``: the state and v boxes on a barrier of their own (the kernel's SPLIT_LOADS)."""
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    RD = cos_angles.shape[3]
    problems = shape_problems(S=S, R=R, N=N, P=P, RD=RD, H=H, chunk_size=chunk_size, block_p=block_p,
                              span_chunks=span_chunks)
    if seg_entry is not None and span_chunks != 1:
        problems.append(f"one chunk a span with segment entry states, got span_chunks={span_chunks}")
    if problems:
        raise ValueError("gluon_chunk_scan: needs " + "; ".join(problems))
    found = descriptors(q=q, k=k, v=v, cos_angles=cos_angles, sin_angles=sin_angles, states=states,
                        chunk_size=chunk_size, block_p=block_p, span_chunks=span_chunks)
    # Through ops/launch.py, so that inside a production call it is recorded and replayed with the other launches.
    launch(_gluon_chunk_scan_kernel, (P // block_p, S // (chunk_size * span_chunks), B * H),
           found["q_desc"], found["k_desc"], found["cos_desc"], found["sin_desc"], found["v_desc"],
           found["states_desc"], q_bias, k_bias, mimo_v, q_bias if d is None else d, v, da_cs, gamma, trap_scale,
           qk_dot, raw_y, raw_y_scale, states, q_bias if seg_entry is None else seg_entry,
           q_bias if entry_decay is None else entry_decay, S, H, G, cdiv(S, chunk_size), RD, chunks_per_segment,
           1 if seg_entry is None else seg_entry.shape[2],
           C=chunk_size, R=R, N=N, P=P, BLOCK_P=block_p, SPAN=span_chunks, ADD_ENTRY=seg_entry is not None,
           HAS_D=d is not None, SPLIT_LOADS=split_loads, num_warps=4)


def compile_for_sm90(case, *, block_p=64, has_d=True, add_entry=False, tables=torch.float16, split_loads=False):
    """The probe compiled for sm_90 on an official shape (B=4, S=2048, H=16, G=1), no GPU needed; spans of as many
    chunks as make R * C * span = 64 rows."""
    from gluon_scan_probe import _Shaped
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from mamba3_mimo.bench import parse_case

    shape = parse_case(case)
    N, P, R, C = shape["N"], shape["P"], shape["R"], shape["chunk_size"]
    B, S, H, G, RD = 4, 2048, 16, 1, N // 4
    span = max(1, ROWS // (R * C))
    problems = shape_problems(S=S, R=R, N=N, P=P, RD=RD, H=H, chunk_size=C, block_p=block_p, span_chunks=span)
    if problems:
        raise ValueError(f"{case}: " + "; ".join(problems))
    base = {dtype: torch.empty(16, dtype=dtype) for dtype in (torch.bfloat16, torch.float16)}
    # tables: the rotation tables' dtype (fp16, or bf16 where the swept rule rotates in bf16: production.py).
    fake = dict(q=_Shaped(base[torch.bfloat16], (B, S, R, G, N)), k=_Shaped(base[torch.bfloat16], (B, S, R, G, N)),
                v=_Shaped(base[torch.bfloat16], (B, S, H, P)),
                cos_angles=_Shaped(base[tables], (B, S, H, RD)), sin_angles=_Shaped(base[tables], (B, S, H, RD)),
                states=_Shaped(base[torch.bfloat16], (B, H, S // C, N, P)))
    types = {name: mangle_type(desc) for name, desc in descriptors(**fake, chunk_size=C, block_p=block_p,
                                                                   span_chunks=span).items()}
    types.update({name: "*fp32" for name in ("q_bias_ptr", "k_bias_ptr", "psi_ptr", "d_ptr", "da_cs_ptr", "gamma_ptr",
                                             "seg_entry_ptr", "entry_decay_ptr",
                                             "trap_scale_ptr", "raw_y_scale_ptr")})
    # qk_dot in the output dtype (bf16 on the official grid).
    types.update(v_ptr="*bf16", raw_y_ptr="*fp16", states_ptr="*bf16", qk_dot_ptr="*bf16")
    types.update({name: "i32" for name in ("S", "H", "G", "NCH", "RD", "CHUNKS_PER_SEG", "N_SEGMENTS")})
    constants = dict(C=C, R=R, N=N, P=P, BLOCK_P=block_p, SPAN=span, ADD_ENTRY=add_entry, HAS_D=has_d,
                     SPLIT_LOADS=split_loads, num_warps=4)
    types.update({name: "constexpr" for name in constants})
    signature = {name: types[name] for name in _gluon_chunk_scan_kernel.arg_names}
    source = GluonASTSource(_gluon_chunk_scan_kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def emulate(*, q, k, v, cos_angles, sin_angles, q_bias, k_bias, mimo_v, d, da_cs, gamma, trap_scale, states, qk_dot,
            raw_y, raw_y_scale, chunk_size, block_p, span_chunks=1, seg_entry=None, entry_decay=None,
            chunks_per_segment=1, **_unused):
    """The probe's programs in torch on the host (fp32 products): its boxes (``descriptors``, the same coordinates,
    TMA's zero fill), in-place rotation, weights, products and stores.  Checks the descriptors and the index arithmetic
    where Gluon cannot run."""
    from gluon_scan_probe import read_box

    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    RD = cos_angles.shape[3]
    C, HALF, L = chunk_size, N // 2, chunk_size * span_chunks
    width = piece_width(N)
    RC, pieces = R * L, HALF // width
    found = descriptors(q=q, k=k, v=v, cos_angles=cos_angles, sin_angles=sin_angles, states=states, chunk_size=C,
                        block_p=block_p, span_chunks=span_chunks)
    t = torch.arange(RC) % L
    r_of = torch.arange(RC) // L
    earlier = t[:, None] > t[None, :]
    same = t[:, None] == t[None, :]
    for pid_p, span, bh in itertools.product(range(P // block_p), range(S // L), range(B * H)):
        b, h = divmod(bh, H)
        g = h // (H // G)
        p0, t0 = pid_p * block_p, span * L
        row = b * S + t0

        def rotated(desc, bias):
            halves = [[read_box(desc, [0, row, g * N + half * HALF + j * width]).float().reshape(RC, width)
                       for j in range(pieces)] for half in range(2)]
            out = []
            for j in range(pieces):
                cols = j * width + torch.arange(width)
                spin = cols < RD
                cos = torch.where(spin, read_box(found["cos_desc"], [row, h * RD + j * width]).float(), 1.0)
                sin = torch.where(spin, read_box(found["sin_desc"], [row, h * RD + j * width]).float(), 0.0)
                cos, sin = cos.repeat(R, 1), sin.repeat(R, 1)  # rank-major rows share their token's angles
                lo = halves[0][j] + bias[h][r_of][:, cols]
                hi = halves[1][j] + bias[h][r_of][:, HALF + cols]
                out.append(((cos * lo - sin * hi).bfloat16().float(), (sin * lo + cos * hi).bfloat16().float()))
            return torch.cat([x for x, _ in out] + [y for _, y in out], dim=1)  # columns: lo pieces, then hi

        q_rot, k_rot = rotated(found["q_desc"], q_bias), rotated(found["k_desc"], k_bias)
        state = torch.cat([read_box(found["states_desc"], [(bh * S // C + span * span_chunks) * N + half * HALF
                                                           + j * width, p0])
                           for half in range(2) for j in range(pieces)]).float()
        seg = span // chunks_per_segment
        if seg_entry is not None and seg > 0:
            entry_state = seg_entry.reshape(B * H, -1, N, P)[bh, seg, :, p0:p0 + block_p]
            full = (state + entry_decay.reshape(B * H, -1)[bh, span] * entry_state).to(states.dtype)
            states.reshape(B * H, -1, N, P)[bh, span, :, p0:p0 + block_p] = full
            state = full.float()
        disc = bh * S + t0
        # da_cs restarts every chunk: re-based to the span's start by its earlier chunks' log decays.
        da = da_cs.reshape(-1)[disc + t] + sum(torch.where(t // C > i, da_cs.reshape(-1)[disc + i * C + C - 1], 0.0)
                                               for i in range(span_chunks - 1))
        weights = torch.where(earlier, torch.exp(torch.where(earlier, da[:, None] - da[None, :], 0.0))
                              * trap_scale.reshape(-1)[disc + t][None, :],
                              torch.where(same, gamma.reshape(-1)[disc + t][:, None], 0.0))
        scores = q_rot @ k_rot.T
        if pid_p == 0:
            qk = qk_dot.view(B * H, S, R, R)[bh, t0:t0 + L]
            qk[t[same.nonzero()[:, 0]], r_of[same.nonzero()[:, 0]], r_of[same.nonzero()[:, 1]]] = \
                scores[same].to(qk_dot.dtype)
        v_tile = read_box(found["v_desc"], [row, h * P + p0]).float()
        psi = mimo_v[h, :, p0:p0 + block_p]
        psiv = (v_tile[None] * psi[:, None]).reshape(RC, block_p)
        out = (scores * weights).bfloat16().float() @ psiv.bfloat16().float() + da.exp()[:, None] * (q_rot @ state)
        if d is not None:
            out += d[h] * psiv
        exp_bits = out.abs().amax(dim=1).view(torch.int32) & 0x7F800000
        exp_bits = torch.clamp(exp_bits, min=27 << 23)
        scale = ((254 << 23) - exp_bits + (14 << 23)).view(torch.float32)
        unscale = (exp_bits - (14 << 23)).view(torch.float32)
        rows = (bh * S + t0 + t) * R + r_of
        raw_y.view(-1, P)[rows, p0:p0 + block_p] = (out * scale[:, None]).half()
        raw_y_scale.view(-1, P // block_p)[rows, pid_p] = unscale


def _small_problem(device, seed, chunk_size=16, N=128):
    """Two P tiles and two segments (N128_P128_R4, or N64_P128_R4, at test size); dA_scale 0.1 so that the state term
    weighs in."""
    from mamba3_mimo.inputs import make_inputs

    return make_inputs(B=1 if device == "cpu" else 2, S=64 if device == "cpu" else 256, H=2, G=1, N=N, P=128, R=4,
                       chunk_size=chunk_size, dtype=torch.bfloat16, seed=seed, dA_scale=0.1, device=device)


def _against_production(inputs, run, dot_dtype, block_p=64, span_chunks=1, local=False):
    """{"raw_y", "qk_dot": max error / max magnitude} of ``run`` (the probe's signature) against the production
    ``chunk_scan`` on the same two-pass states; every output starts as NaN.  ``local``: segment-local states with
    the segments' entry states (``chunk_local_states``, ``segment_entry_states``), and "states": the full states
    both write back over their copies of the local ones."""
    from gluon_scan_probe import poisoned

    from mamba3_mimo.ops.chunk_scan import chunk_scan
    from mamba3_mimo.ops.chunk_state import chunk_local_states, chunk_states, segment_end_states
    from mamba3_mimo.ops.state_passing import segment_entry_states
    from mamba3_mimo.ops.token_tables import token_tables

    B, S, R, G, N = inputs["q"].shape
    H, P = inputs["v"].shape[2:]
    C, device = inputs["chunk_size"], inputs["q"].device
    gamma, trap_scale, cos_angles, sin_angles = token_tables(dt=inputs["dt"], trap=inputs["trap"],
                                                             angles=inputs["angles"], rotation_dtype=torch.float16)
    common = dict(k=inputs["k"], v=inputs["v"], cos_angles=cos_angles, sin_angles=sin_angles, k_bias=inputs["k_bias"],
                  mimo_v=inputs["mimo_v"], da_cs=inputs["da_cs"], da_cs_rev=inputs["da_cs_rev"], gamma=gamma,
                  trap_scale=trap_scale, chunk_size=C, block_p=block_p, dot_dtype=dot_dtype, dot_precision="ieee")
    states = torch.empty((B, H, S // C, N, P), dtype=torch.bfloat16, device=device)
    scan = dict(common, n_segments=2, chunks_per_segment=S // C // 2, block_half=N // 2, num_warps=4)
    entry = {}
    if local:
        seg_entry = chunk_local_states(**scan, states=states, span_chunks=1)
        entry = dict(seg_entry=seg_entry, chunks_per_segment=scan["chunks_per_segment"],
                     entry_decay=segment_entry_states(seg_state=seg_entry, da_cs=inputs["da_cs"], chunk_size=C,
                                                      chunks_per_segment=scan["chunks_per_segment"]))
    else:
        seg_end = segment_end_states(**scan, span_chunks=1)
        chunk_states(**scan, seg_state=seg_end, states=states, span_chunks=1)
    output = dict(common, q=inputs["q"], q_bias=inputs["q_bias"], d=inputs["d"], **entry)
    results = {}
    for name, call in (("production", chunk_scan), ("probe", run)):
        qk_dot = poisoned((B, H, S, R, R), device, torch.float32)
        raw_y = poisoned((B, H, S, R, P), device, torch.float16)
        raw_y_scale = poisoned((B, H, S, R, P // block_p), device, torch.float32)
        own_states = states.clone()  # both write the full states back in the local schedule
        call(**output, states=own_states, qk_dot=qk_dot, raw_y=raw_y, raw_y_scale=raw_y_scale,
             span_chunks=span_chunks)
        results[name] = (raw_y.float() * raw_y_scale.repeat_interleave(block_p, dim=-1), qk_dot, own_states.float())
    (want_y, want_qk, want_states), (got_y, got_qk, got_states) = results["production"], results["probe"]
    errors = dict(raw_y=float((got_y - want_y).abs().max() / want_y.abs().max()),
                  qk_dot=float((got_qk - want_qk).abs().max() / want_qk.abs().max()))
    if local:
        errors["states"] = float((got_states - want_states).abs().max() / want_states.abs().max())
    return errors


def _check(device, run, dot_dtype, seed):
    """{"raw_y", "qk_dot"}: one chunk of 16 a program; "_span2": spans of two chunks of 8; "_local": the local-state
    schedule's segment entry (and "states_local", the states written back); "_n64": N = 64 (32-wide pieces) in the
    local-state schedule."""
    errors = _against_production(_small_problem(device, seed), run, dot_dtype)
    spans = _against_production(_small_problem(device, seed, chunk_size=8), run, dot_dtype, span_chunks=2)
    local = _against_production(_small_problem(device, seed), run, dot_dtype, local=True)
    n64 = _against_production(_small_problem(device, seed, N=64), run, dot_dtype, local=True)
    return dict(errors, **{name + "_span2": error for name, error in spans.items()},
                **{name + "_local": error for name, error in local.items()},
                **{name + "_n64": error for name, error in n64.items()})


def check_emulation(seed=7):
    """CPU: ``emulate`` against the production ``chunk_scan`` (interpreter, fp32 products: the interpreter
    miscomputes bf16 tl.dot) on small two-pass problems."""
    import triton.language as tl

    return _check("cpu", emulate, tl.float32, seed)


def check_gpu(seed=7, split_loads=False):
    """Hopper GPU: the probe kernel against the production ``chunk_scan`` (bf16 products) on the same problems at
    B = 2, S = 256."""
    import functools

    import triton.language as tl

    return _check("cuda", functools.partial(gluon_chunk_scan, split_loads=split_loads), tl.bfloat16, seed)


class probe_in_production:
    """Within it, production calls run the probe in place of ``chunk_scan`` where it covers the call (an fp16 raw_y;
    one span a program; one chunk a span with the local-state schedule's entry states) and count those calls in
    ``self.calls``."""

    def __init__(self, split_loads=False):
        self.split_loads = split_loads

    def __enter__(self):
        from mamba3_mimo.ops import production

        self.module, self.original, self.calls = production, production.chunk_scan, []
        _forget_recorded_calls()  # a call recorded without the probe has the same plan key: it would be replayed

        def chunk_scan(**kwargs):
            q, v, raw_y = kwargs["q"], kwargs["v"], kwargs.get("raw_y")
            B, S, R, G, N = q.shape
            covered = (raw_y is not None and raw_y.dtype == torch.float16 and kwargs.get("spans_per_program", 1) == 1
                       and (kwargs.get("seg_entry") is None or kwargs.get("span_chunks", 1) == 1)
                       and q.dtype == v.dtype == torch.bfloat16 and kwargs["states"].dtype in STATES_DTYPES
                       and not shape_problems(S=S, R=R, N=N, P=v.shape[3], RD=kwargs["cos_angles"].shape[3],
                                              H=v.shape[2], chunk_size=kwargs["chunk_size"],
                                              block_p=kwargs["block_p"], span_chunks=kwargs.get("span_chunks", 1)))
            if not covered:
                return self.original(**kwargs)
            self.calls.append(1)
            return gluon_chunk_scan(**kwargs, split_loads=self.split_loads)

        production.chunk_scan = chunk_scan
        return self

    def __exit__(self, *exc):
        self.module.chunk_scan = self.original
        _forget_recorded_calls()
        return False


def _forget_recorded_calls():
    from mamba3_mimo.ops import launch as launch_module

    launch_module._calls.clear()
    launch_module._plan_slots.clear()


def time_case(case, *, n_segments=None):
    """Hopper GPU, an official shape (B=4, S=2048, H=16, bf16, Z on): graph us and per-kernel us of whole calls with
    the dispatcher's config, the same with the probe as chunk_scan, two passes with the Gluon state scan, and those
    with the probe (P tiles of at most 64); and the probe's accuracy against the float64 reference on a smaller
    problem (B=1, S=512, H=4) in both schedules."""
    import dataclasses

    from mamba3_mimo.accuracy import check_outputs
    from mamba3_mimo.api import bwd_fwd
    from mamba3_mimo.bench import graph_time, kernel_breakdown, parse_case
    from mamba3_mimo.inputs import make_inputs
    from mamba3_mimo.ops.production import choose_config
    from mamba3_mimo.reference import bwd_fwd_reference

    shape = parse_case(case)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = choose_config(B=4, H=16, S=2048, num_sms=num_sms, **shape)
    two = dataclasses.replace(base, local_states=False, gluon_scan=True, n_segments=n_segments or base.n_segments)
    # The probe's P tiles are 32 or 64.
    base_probe = dataclasses.replace(base, out_block_p=min(base.out_block_p, 64))
    two_probe = dataclasses.replace(two, out_block_p=min(two.out_block_p, 64))
    input_sets = [make_inputs(B=4, S=2048, H=16, G=1, dtype=torch.bfloat16, device="cuda", seed=seed, **shape)
                  for seed in (0, 1)]
    record = dict(case=case, n_segments=two.n_segments)
    for name, config, probe in (("dispatcher", base, False), ("dispatcher_probe", base_probe, True),
                                 ("two_pass", two, False), ("two_pass_probe", two_probe, True)):
        with probe_in_production() if probe else contextlib.nullcontext() as patch:
            record[name + "_graph_us"] = graph_time(input_sets, "production", torch.bfloat16, config=config) * 1e3
            record[name + "_kernels_us"] = kernel_breakdown(input_sets[0], "production", torch.bfloat16,
                                                            config=config)[0]
            if probe:
                record[name + "_calls"] = len(patch.calls)
                inputs = make_inputs(B=1, S=512, H=4, G=1, dtype=torch.bfloat16, device="cuda", seed=3, **shape)
                small = dataclasses.replace(config, n_segments=2)
                outputs = bwd_fwd(**inputs, output_dtype=torch.bfloat16, config=small)
                golden = bwd_fwd_reference(**inputs, compute_dtype=torch.float64)
                bench = bwd_fwd_reference(**inputs, compute_dtype=torch.bfloat16)
                checks = check_outputs(outputs, golden, bench, torch.bfloat16, torch.bfloat16)
                record[name + "_accuracy"] = {check.name: check.passed for check in checks}
    return record



def time_split(case):
    """Hopper GPU, an official shape (B=4, S=2048, H=16, bf16, Z on): graph us and per-kernel us of whole calls, two
    passes with the Gluon state scan and P tiles of at most 64, with the Triton chunk_scan, the probe with every box
    on one barrier, and the probe with the state and v boxes on a second (``split_loads``)."""
    import dataclasses

    from mamba3_mimo.bench import graph_time, kernel_breakdown, parse_case
    from mamba3_mimo.inputs import make_inputs
    from mamba3_mimo.ops.production import choose_config

    shape = parse_case(case)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = choose_config(B=4, H=16, S=2048, num_sms=num_sms, **shape)
    two = dataclasses.replace(base, local_states=False, gluon_scan=True, out_block_p=min(base.out_block_p, 64))
    input_sets = [make_inputs(B=4, S=2048, H=16, G=1, dtype=torch.bfloat16, device="cuda", seed=seed, **shape)
                  for seed in (0, 1)]
    record = dict(case=case, n_segments=two.n_segments, out_block_p=two.out_block_p)
    for name, probe in (("triton", None), ("probe", False), ("probe_split", True)):
        with probe_in_production(split_loads=probe) if probe is not None else contextlib.nullcontext():
            record[name + "_graph_us"] = graph_time(input_sets, "production", torch.bfloat16, config=two) * 1e3
            record[name + "_kernels_us"] = kernel_breakdown(input_sets[0], "production", torch.bfloat16,
                                                            config=two)[0]
    return record

CASES = ["N128_P64_R4_C16", "N128_P32_R4_C16", "N128_P64_R8_C8", "N128_P64_R2_C32", "N128_P64_R1_C64",
         "N128_P128_R4_C8", "N64_P64_R4_C16", "N64_P128_R4_C16"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--emulate", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="Hopper GPU: values against chunk_scan, then timings")
    parser.add_argument("--cases", nargs="+", default=CASES)
    parser.add_argument("--json", help="with --gpu: write the records here")
    parser.add_argument("--split-loads", action="store_true",
                        help="with --gpu: check the split-barrier kernel's values, then time_split on --cases")
    parser.add_argument("--split", action="store_true", help="with --compile-only: the split-barrier kernel")
    args = parser.parse_args(argv)
    if args.emulate:
        print(check_emulation(), flush=True)
    if args.gpu:
        records = [dict(case="small", split_loads=args.split_loads, **check_gpu(split_loads=args.split_loads))]
        print(records[-1], flush=True)
        if max(v for k, v in records[-1].items() if isinstance(v, float)) > 1e-2:
            print("values off: no timing", flush=True)
            args.cases = []
        for case in args.cases:
            records.append(time_split(case) if args.split_loads else time_case(case))
            print(records[-1], flush=True)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(records, out, indent=1)
    if args.compile_only:
        from gluon_scan_probe import summary

        from mamba3_mimo.bench import parse_case

        for case in args.cases:
            block_p = 32 if "P32" in case else 64
            shape = parse_case(case)
            # The local-state schedule's entry term where a program takes one chunk.
            for add_entry in (False, True) if shape["R"] * shape["chunk_size"] == ROWS else (False,):
                print(dict(case=case, block_p=block_p, add_entry=add_entry, split=args.split,
                           **summary(compile_for_sm90(case, block_p=block_p, add_entry=add_entry,
                                                      split_loads=args.split))), flush=True)


if __name__ == "__main__":
    main()
