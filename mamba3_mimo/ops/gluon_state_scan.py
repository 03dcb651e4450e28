"""The state scan as a warp-specialized Gluon kernel for Hopper: a TMA producer warp and a wgmma consumer warpgroup.

The production scans (``chunk_state.py``) gather each chunk's rows with pointer tiles and wait on those loads
(28-35% of their issue rate, docs/optimization.md section 31); Triton's ``tl`` gives them no producer / consumer
split (section 32).  Here Gluon (``triton.experimental.gluon``) states the split itself (section 33):

- a 1-warp producer partition (40 registers) streams each chunk's tiles into a ring of shared-memory stages with
  TMA: k as two [R, C, 64] boxes of k viewed as [R, B * S, G * N] (a chunk's rows land rank-major, so each rank's
  [C, 64] block shares its tokens' tiles without a broadcast), cos / sin as [C, 64] boxes of the [B * S, H * RD]
  tables (or, with ``angles_in_kernels``, one fp32 box of the angles, from which the consumer computes the tables'
  values) and v as a [C, P tile] box;
- the 4-warp consumer partition (232 registers) rotates k (in fp32, or in bf16 where the production scans'
  ``rotation_math_dtype`` is 16-bit), weighs v, writes the update's operands to shared memory,
  releases the stage and runs ``state = decay * state + k~^T @ psiv`` as two wgmma, one per N/2 half, into
  [64, P tile] fp32 accumulators; entering states leave through shared memory as asynchronous TMA stores.  Where
  shared memory allows, the operands have two sets and a step's wgmma runs while the next chunk is rotated
  (``update_operand_buffers``).

One program per (N/2 tile x P tile, segment, (b, h)), each holding a [2 x 64, P tile] piece of the state (at N = 64
the whole [2 x 32, P tile] state, its halves stacked in one 64-row accumulator: ``half_columns``), in the
production scan's three roles (``ROLES``), with the same arguments as its wrappers.  What it covers
(``unsupported``): a Hopper GPU, bf16 k and states, fp16 or bf16 rotation tables, N = 64 or a multiple of 128, a P
tile of 32 or 64, C a multiple of 8, R a power of two, C * R a multiple of 16 up to 256, S a multiple of C, 16-byte
aligned tensors.  ``ScanConfig.gluon_scan`` routes the production path's scans here where it applies; Gluon does not
run in the Triton interpreter, so its values are tested on the GPU (``tests/test_gluon_state_scan.py``) and its
index arithmetic on the CPU by a replay in torch (``benchmarks/gluon_scan_probe.py``).
"""

import functools

import torch
import triton
import triton.language as tl
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
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .host_utils import cdiv, rotation_source
from .launch import launch
from .triton_utils import table_cos_sin, wait_for_previous_grid

SMEM_LIMIT = 101_376  # the project's per-launch shared-memory bound (99 KB)
BLOCK_HALF = 64  # columns of each N/2 half a program holds: one 128-byte swizzled bf16 box row
STATE_ROWS = 64  # rows of a wgmma accumulator (one warpgroup's M)
_STATE_ROWS = gl.constexpr(STATE_ROWS)  # the same, for the kernels


def half_columns(N):
    """Columns of each N/2 half a program holds: 64, or N/2 = 32 at N = 64, where the two halves are stacked into
    one 64-row accumulator (wgmma's M is 64 rows)."""
    return min(BLOCK_HALF, N // 2)

PRODUCER_REGISTERS = gl.constexpr(40)
# State-store buffers a half at most (``state_store_buffers``).  Two spare each step the wait for the previous step's
# TMA store to finish reading its buffer; beside two operand sets they gained nothing (H100, section 48), so one.
MAX_STATE_STORE_BUFFERS = 1
# Sets of update operands at most (``update_operand_buffers``).  Two let a step's wgmma run while the consumer rotates
# the next chunk into the other set: where they fit (N = 64, C = 8 at 64-wide P tiles) the scan takes 1-4% less
# (H100, section 48: N64_P128 scan 92 -> 89 us, N128_P128 264 -> 261), the calls 0-0.7%.
MAX_OPERAND_BUFFERS = 2
# A chunk's per-token da_rev and trap_scale and its decay reach the consumer in the ring, copied by the producer with
# cp.async, rather than loaded a step ahead by the consumer, whose loop waits on those loads (14% of its stalls at
# N64_P64, section 48).  ``ring_weights`` says where a launch takes them; False turns them off everywhere.
RING_WEIGHTS = True
# Registers a thread at launch: 8 hardware warps at 128 fit two programs an SM; a lower cap (``max_registers``) fits
# more where shared memory allows (64: four at N = 64 with 32-wide P tiles).
MAX_REGISTERS = 128


@gluon.constexpr_function
def _rows_layout(cols, num_warps):
    """[rows, cols] elementwise tiles: a warp's lanes across the columns, the warps down the rows."""
    lanes = min(32, cols)
    return gl.BlockedLayout([1, max(1, cols // 32)], [32 // lanes, lanes], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def half_rows_layout(block_half, num_warps):
    """A rank's [C, N/2 piece] rows of q or k for the bias add and rotation.  At 32 columns (N = 64) 4 columns (8
    bytes) a thread, a warp's lanes over 4 rows, not one 2-byte column a lane; else ``_rows_layout``."""
    if block_half < 64:
        return gl.BlockedLayout([1, 4], [4, 8], [num_warps, 1], [1, 0])
    return _rows_layout(block_half, num_warps)


@gluon.constexpr_function
def _state_layout(block_p, num_warps):
    """The wgmma accumulator of one [64, P tile] piece of a state half."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_p, 16])


@gluon.jit
def _producer(k_desc, cos_desc, sin_desc, v_desc, k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs,
              decay_bufs, da_rev_ptr, trap_scale_ptr, da_cs_ptr, ready, empty, b, h, g, bh, t_first, n0, p0, S,
              n_steps, C: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr, GDC: gl.constexpr,
              RING_WEIGHTS: gl.constexpr, FROM_ANGLES: gl.constexpr):
    # The producer warp's TMA loads read the previous kernel's tables: it waits for that grid itself rather than
    # relying on how the partitions are entered.
    wait_for_previous_grid(GDC)
    HALF: gl.constexpr = N // 2
    NUM_BUFFERS: gl.constexpr = k_lo_bufs.type.shape[0]
    # From angles, cos_desc is the fp32 angles' box (as many bytes as a 16-bit cos box and sin box together).
    STEP_BYTES: gl.constexpr = (2 * k_desc.block_type.nbytes + (2 - FROM_ANGLES) * cos_desc.block_type.nbytes
                                + v_desc.block_type.nbytes)
    token = gl.arange(0, C, gl.BlockedLayout([1], [32], [1], [0]))
    last = gl.arange(0, 1, gl.BlockedLayout([1], [32], [1], [0]))
    for i in range(n_steps):
        stage = i % NUM_BUFFERS
        # A fresh mbarrier counts as having completed phase 1, so the first pass through the ring does not wait.
        mbarrier.wait(empty.index(stage), ((i // NUM_BUFFERS) & 1) ^ 1)
        row = b * S + t_first + i * C
        bar = ready.index(stage)
        if RING_WEIGHTS:
            # The chunk's rows of da_rev and trap_scale and its decay (fp32, [B * H, S]; da_cs is chunk-local, its
            # last value the chunk's decay); the stage's barrier also waits for these copies (each thread's arrive,
            # counted in, fires once its copies have landed).
            weights = bh * S + t_first + i * C
            async_copy.async_copy_global_to_shared(weight_bufs.index(2 * stage), da_rev_ptr + weights + token)
            async_copy.async_copy_global_to_shared(weight_bufs.index(2 * stage + 1), trap_scale_ptr + weights + token)
            async_copy.async_copy_global_to_shared(decay_bufs.index(stage), da_cs_ptr + weights + C - 1 + last)
            async_copy.mbarrier_arrive(bar)
        mbarrier.expect(bar, STEP_BYTES)
        tma.async_copy_global_to_shared(k_desc, [0, row, g * N + n0], bar, k_lo_bufs.index(stage))
        tma.async_copy_global_to_shared(k_desc, [0, row, g * N + HALF + n0], bar, k_hi_bufs.index(stage))
        tma.async_copy_global_to_shared(cos_desc, [row, h * RD + n0], bar, cos_bufs.index(stage))
        if not FROM_ANGLES:
            tma.async_copy_global_to_shared(sin_desc, [row, h * RD + n0], bar, sin_bufs.index(stage))
        tma.async_copy_global_to_shared(v_desc, [row, h * P + p0], bar, v_bufs.index(stage))


@gluon.jit
def _chunk_weights(da_rev_ptr, trap_scale_ptr, da_cs_ptr, at, token, valid, C: gl.constexpr):
    """A chunk's per-token da_rev and trap_scale and its log decay (da_cs is chunk-local: its last value), from
    position ``at`` of the [B * H, S] tables; zeros where ``valid`` is false (None: always valid)."""
    if valid is None:
        da_rev = gl.load(da_rev_ptr + at + token)
        trap_scale = gl.load(trap_scale_ptr + at + token)
        log_decay = gl.load(da_cs_ptr + at + C - 1)
    else:
        da_rev = gl.load(da_rev_ptr + at + token, mask=valid & (token < C), other=0.0)
        trap_scale = gl.load(trap_scale_ptr + at + token, mask=valid & (token < C), other=0.0)
        log_decay = gl.load(da_cs_ptr + at + C - 1, mask=valid, other=0.0)
    return da_rev, trap_scale, log_decay


@gluon.jit
def biased_rank_rows(lo_rows, hi_rows, bias_lo, bias_hi, r, C: gl.constexpr, layout: gl.constexpr,
                     DTYPE: gl.constexpr):
    """Rank ``r``'s [C, 64] rows of both N/2 halves from a stage's rank-major [R * C, 64] rows, in DTYPE, with the
    rank's bias rows (``bias_lo`` / ``bias_hi`` [R, 64] in shared memory) added."""
    x_lo = lo_rows.slice(r * C, C).load(layout).to(DTYPE) + bias_lo.index(r).load(gl.SliceLayout(0, layout))[None, :]
    x_hi = hi_rows.slice(r * C, C).load(layout).to(DTYPE) + bias_hi.index(r).load(gl.SliceLayout(0, layout))[None, :]
    return x_lo, x_hi


@gluon.jit
def store_rotated_rows(x_lo, x_hi, cos, sin, out_lo, out_hi, r, C: gl.constexpr, STACKED: gl.constexpr):
    """Rank ``r``'s rows of both N/2 halves, rotated, as bf16 operand rows (rank-major): in ``out_lo`` and
    ``out_hi``, or STACKED (N = 64) as one [C, 64] row block [lo | hi] of ``out_lo``, the columns as in memory
    (joined in registers: one store, where two column slices took a barrier more a rank)."""
    if STACKED:
        pairs = gl.join((cos * x_lo - sin * x_hi).to(gl.bfloat16), (sin * x_lo + cos * x_hi).to(gl.bfloat16))
        out_lo.slice(r * C, C).store(gl.reshape(gl.permute(pairs, (0, 2, 1)), [C, 2 * x_lo.shape[1]]))
    else:
        out_lo.slice(r * C, C).store((cos * x_lo - sin * x_hi).to(gl.bfloat16))
        out_hi.slice(r * C, C).store((sin * x_lo + cos * x_hi).to(gl.bfloat16))


@gluon.jit
def _stage_operands(step, stage, k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs, decay_bufs, ready,
                    empty, a_lo, a_hi, psiv, bias_lo_smem, bias_hi_smem, psi_smem, rotated, log_decay, da_rev,
                    trap_scale, C: gl.constexpr, R: gl.constexpr, STACKED: gl.constexpr, ROTATION_DTYPE: gl.constexpr,
                    k_layout: gl.constexpr, p_layout: gl.constexpr, RING_WEIGHTS: gl.constexpr,
                    TABLE_DTYPE: gl.constexpr):
    """Step ``step``'s update operands from its ring stage (``stage``, step % ring depth): k~ (a_lo / a_hi, rows
    (rank, token)) and the weighted psiv; the stage is then released to the producer.  Returns the chunk's decay,
    exp(``log_decay``).  With ``RING_WEIGHTS`` the chunk's weights and decay come from the stage's weight slot
    (``log_decay``, ``da_rev`` and ``trap_scale`` are not used).  A TABLE_DTYPE (not None) says the stage holds the
    chunk's fp32 angles in ``cos_bufs``: their cos / sin are computed here as ``token_tables`` would store them."""
    BLOCK_HALF: gl.constexpr = k_lo_bufs.type.shape[3]
    NUM_BUFFERS: gl.constexpr = k_lo_bufs.type.shape[0]
    mbarrier.wait(ready.index(stage), (step // NUM_BUFFERS) & 1)
    if RING_WEIGHTS:
        token_layout: gl.constexpr = gl.SliceLayout(1, p_layout)
        da_rev = weight_bufs.index(2 * stage).load(token_layout)
        trap_scale = weight_bufs.index(2 * stage + 1).load(token_layout)
        # A one-element sum: the scalar out of its slot, no data leaves a thread.
        log_decay = gl.sum(decay_bufs.index(stage).load(gl.BlockedLayout([1], [32], [gl.num_warps()], [0])), axis=0)
    decay = gl.exp(log_decay)
    weight = gl.exp(da_rev) * trap_scale
    if TABLE_DTYPE is None:
        cos = gl.where(rotated, cos_bufs.index(stage).load(k_layout).to(ROTATION_DTYPE), 1.0)
        sin = gl.where(rotated, sin_bufs.index(stage).load(k_layout).to(ROTATION_DTYPE), 0.0)
    else:
        cos, sin = table_cos_sin(cos_bufs.index(stage).load(k_layout), TABLE_DTYPE, True)
        cos = gl.where(rotated, cos.to(ROTATION_DTYPE), 1.0)
        sin = gl.where(rotated, sin.to(ROTATION_DTYPE), 0.0)
    v_weighted = v_bufs.index(stage).load(p_layout).to(gl.float32) * weight[:, None]
    k_lo_rows = k_lo_bufs.index(stage).reshape([R * C, BLOCK_HALF])
    k_hi_rows = k_hi_bufs.index(stage).reshape([R * C, BLOCK_HALF])
    for r in gl.static_range(R):
        k_lo, k_hi = biased_rank_rows(k_lo_rows, k_hi_rows, bias_lo_smem, bias_hi_smem, r, C, k_layout,
                                      ROTATION_DTYPE)
        store_rotated_rows(k_lo, k_hi, cos, sin, a_lo, a_hi, r, C, STACKED)
        psi = psi_smem.index(r).load(gl.SliceLayout(0, p_layout))
        psiv.slice(r * C, C).store((v_weighted * psi[None, :]).to(gl.bfloat16))
    # Orders this partition's shared-memory reads and writes before the producer's next TMA into the stage and
    # before the wgmma reads of the operands.
    fence_async_shared()
    mbarrier.arrive(empty.index(stage), count=1)
    return decay


@gluon.jit
def entering_segment_state(seg_state_ptr, da_cs_ptr, bh, n0, p0, seg, S, CHUNKS_PER_SEG, N_SEGMENTS, C: gl.constexpr,
                           N: gl.constexpr, P: gl.constexpr, BLOCK_P: gl.constexpr, BLOCK_SEG_CHUNKS: gl.constexpr,
                           STACKED: gl.constexpr, FOLD_EARLIER: gl.constexpr, acc_layout: gl.constexpr,
                           num_warps: gl.constexpr):
    """The state a segment's scan starts from, as the [64, P tile] accumulators of its two N/2 halves (stacked: the
    first holds both, the second is not used): zeros, or with FOLD_EARLIER (the storing pass of two) the earlier
    segments' end states folded, s <- exp(segment log decay) s + end state, from seg_state [B, H, segments, N, P]."""
    HALF: gl.constexpr = N // 2
    rows = n0 + gl.arange(0, _STATE_ROWS, gl.SliceLayout(1, acc_layout))
    cols = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, acc_layout))
    tile = rows[:, None] * P + cols[None, :]
    state_lo = gl.zeros([_STATE_ROWS, BLOCK_P], gl.float32, acc_layout)
    state_hi = gl.zeros([_STATE_ROWS, BLOCK_P], gl.float32, acc_layout)
    if FOLD_EARLIER:
        chunk = gl.arange(0, BLOCK_SEG_CHUNKS, gl.BlockedLayout([1], [32], [num_warps], [0]))
        for earlier in range(0, seg):
            chunk_ends = (earlier * CHUNKS_PER_SEG + chunk) * C + C - 1
            segment_decay = gl.exp(gl.sum(gl.load(da_cs_ptr + bh * S + chunk_ends, mask=chunk < CHUNKS_PER_SEG,
                                                  other=0.0), axis=0))
            end_state = seg_state_ptr + (bh * N_SEGMENTS + earlier) * N * P + tile
            state_lo = state_lo * segment_decay + gl.load(end_state)
            if not STACKED:
                state_hi = state_hi * segment_decay + gl.load(end_state + HALF * P)
    return state_lo, state_hi


@gluon.jit
def _store_entering_state(i, state_lo, state_hi, out_lo_smem, out_hi_smem, states_desc, row, p0,
                          HALF: gl.constexpr, STACKED: gl.constexpr):
    """The state entering a chunk (its first row ``row`` of ``states`` viewed as rows of P) goes out through shared
    memory as an asynchronous TMA store.  With one buffer the previous chunk's store must have finished reading it
    (it had a whole step); with two, the store of two chunks back (STORE_BUFFERS - 1 groups may still be reading)."""
    STORE_BUFFERS: gl.constexpr = out_lo_smem.type.shape[0]
    out_lo = out_lo_smem.index(i % STORE_BUFFERS)
    out_hi = out_hi_smem.index(i % STORE_BUFFERS)
    tma.store_wait(STORE_BUFFERS - 1)
    out_lo.store(state_lo.to(gl.bfloat16))
    if not STACKED:
        out_hi.store(state_hi.to(gl.bfloat16))
    fence_async_shared()
    tma.async_copy_shared_to_global(states_desc, [row, p0], out_lo)
    if not STACKED:
        tma.async_copy_shared_to_global(states_desc, [row + HALF, p0], out_hi)


@gluon.jit
def _consumer(k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs, decay_bufs, da_rev_ptr, trap_scale_ptr,
              ready, empty, a_lo_smem, a_hi_smem, psiv_smem, out_lo_smem, out_hi_smem, bias_lo_smem, bias_hi_smem,
              psi_smem, states_desc, seg_state_ptr, da_cs_ptr, bh, c_first, n0, p0, S, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
              seg, n_steps, C: gl.constexpr, R: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr,
              BLOCK_P: gl.constexpr, STORE_STATES: gl.constexpr, FOLD_EARLIER: gl.constexpr, STORE_END: gl.constexpr,
              BLOCK_SEG_CHUNKS: gl.constexpr, HALF_ROTATION: gl.constexpr, RING_WEIGHTS: gl.constexpr,
              TABLE_DTYPE: gl.constexpr, num_warps: gl.constexpr):
    HALF: gl.constexpr = N // 2
    # k's bias add and rotation in bf16 (two elements a register, no conversion before the operand store) or fp32:
    # the production scans' rotation_math_dtype.
    ROTATION_DTYPE: gl.constexpr = gl.bfloat16 if HALF_ROTATION else gl.float32
    BLOCK_HALF: gl.constexpr = k_lo_bufs.type.shape[3]
    # N = 64: the halves' 32 rows each are stacked in one [64, P tile] state (rows n, as in memory).
    STACKED: gl.constexpr = BLOCK_HALF < _STATE_ROWS
    NUM_BUFFERS: gl.constexpr = k_lo_bufs.type.shape[0]
    # Two sets of update operands: a step's wgmma runs while the next chunk is rotated into the other set.
    PIPELINED: gl.constexpr = a_lo_smem.type.shape[0] > 1
    k_layout: gl.constexpr = half_rows_layout(BLOCK_HALF, num_warps)
    p_layout: gl.constexpr = _rows_layout(BLOCK_P, num_warps)
    acc_layout: gl.constexpr = _state_layout(BLOCK_P, num_warps)
    token_layout: gl.constexpr = gl.SliceLayout(1, p_layout)

    # Columns past RD are not rotated; their boxes hold the next head's angles (zeros past the table's end).
    rotated = (n0 + gl.arange(0, BLOCK_HALF, gl.SliceLayout(0, k_layout)) < RD)[None, :]
    rows = n0 + gl.arange(0, _STATE_ROWS, gl.SliceLayout(1, acc_layout))
    cols = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, acc_layout))
    tile = rows[:, None] * P + cols[None, :]
    # Stacked, state_lo is the whole state and state_hi is not used.
    state_lo, state_hi = entering_segment_state(seg_state_ptr, da_cs_ptr, bh, n0, p0, seg, S, CHUNKS_PER_SEG,
                                                N_SEGMENTS, C, N, P, BLOCK_P, BLOCK_SEG_CHUNKS, STACKED, FOLD_EARLIER,
                                                acc_layout, num_warps)
    # The per-token weights and the chunk decay are a few floats a chunk: loaded one chunk ahead from global memory
    # (1-D TMA boxes of them would land at shared addresses short of TMA's 128-byte alignment), or, with
    # RING_WEIGHTS, copied into the ring by the producer.
    token = gl.arange(0, C, token_layout)
    disc = bh * S + c_first * C
    if RING_WEIGHTS:
        # The weights arrive in each stage's weight slot (``_stage_operands``): nothing to load here.
        next_da_rev, next_trap_scale, next_log_decay = 0.0, 0.0, gl.to_tensor(0.0)
    else:
        next_da_rev, next_trap_scale, next_log_decay = _chunk_weights(da_rev_ptr, trap_scale_ptr, da_cs_ptr, disc,
                                                                      token, None, C)
    if PIPELINED:
        # Chunk 0's operands before the loop (a segment of no chunks would wait for a stage the producer never
        # fills); each step then stages chunk i + 1's while chunk i's wgmma runs.
        decay = next_log_decay
        if n_steps > 0:
            decay = _stage_operands(0, 0, k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs, decay_bufs,
                                    ready, empty, a_lo_smem.index(0), a_hi_smem.index(0), psiv_smem.index(0),
                                    bias_lo_smem, bias_hi_smem, psi_smem, rotated, next_log_decay, next_da_rev,
                                    next_trap_scale, C, R, STACKED, ROTATION_DTYPE, k_layout, p_layout, RING_WEIGHTS,
                                    TABLE_DTYPE)
        if not RING_WEIGHTS:
            next_da_rev, next_trap_scale, next_log_decay = _chunk_weights(da_rev_ptr, trap_scale_ptr, da_cs_ptr,
                                                                          disc + C, token, n_steps > 1, C)
        for i in range(n_steps):
            if STORE_STATES:
                _store_entering_state(i, state_lo, state_hi, out_lo_smem, out_hi_smem, states_desc,
                                      (bh * NCH + c_first + i) * N + n0, p0, HALF, STACKED)
            operands = i % 2
            state_lo = warpgroup_mma(a_lo_smem.index(operands).permute((1, 0)), psiv_smem.index(operands),
                                     state_lo * decay, is_async=True)
            if not STACKED:
                state_hi = warpgroup_mma(a_hi_smem.index(operands).permute((1, 0)), psiv_smem.index(operands),
                                         state_hi * decay, is_async=True)
            # The next chunk's operands go to the other set, whose last reader (step i - 1's wgmma) has been waited
            # for; its weights were loaded a step ahead (or come in its stage), those of the chunk after it now.
            da_rev, trap_scale, log_decay = next_da_rev, next_trap_scale, next_log_decay
            if not RING_WEIGHTS:
                next_da_rev, next_trap_scale, next_log_decay = _chunk_weights(
                    da_rev_ptr, trap_scale_ptr, da_cs_ptr, disc + (i + 2) * C, token, i + 2 < n_steps, C)
            if i + 1 < n_steps:
                decay = _stage_operands(i + 1, (i + 1) % NUM_BUFFERS, k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs,
                                        weight_bufs, decay_bufs, ready, empty, a_lo_smem.index(1 - operands),
                                        a_hi_smem.index(1 - operands), psiv_smem.index(1 - operands), bias_lo_smem,
                                        bias_hi_smem, psi_smem, rotated, log_decay, da_rev, trap_scale, C, R, STACKED,
                                        ROTATION_DTYPE, k_layout, p_layout, RING_WEIGHTS, TABLE_DTYPE)
            if STACKED:
                state_lo = warpgroup_mma_wait(0, deps=(state_lo,))
            else:
                state_lo, state_hi = warpgroup_mma_wait(0, deps=(state_lo, state_hi))
    else:
        for i in range(n_steps):
            stage = i % NUM_BUFFERS
            da_rev, trap_scale, log_decay = next_da_rev, next_trap_scale, next_log_decay
            if not RING_WEIGHTS:
                next_da_rev, next_trap_scale, next_log_decay = _chunk_weights(
                    da_rev_ptr, trap_scale_ptr, da_cs_ptr, disc + (i + 1) * C, token, i + 1 < n_steps, C)
            if STORE_STATES:
                _store_entering_state(i, state_lo, state_hi, out_lo_smem, out_hi_smem, states_desc,
                                      (bh * NCH + c_first + i) * N + n0, p0, HALF, STACKED)
            decay = _stage_operands(i, stage, k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs, decay_bufs,
                                    ready, empty, a_lo_smem.index(0), a_hi_smem.index(0), psiv_smem.index(0),
                                    bias_lo_smem, bias_hi_smem, psi_smem, rotated, log_decay, da_rev, trap_scale, C, R,
                                    STACKED, ROTATION_DTYPE, k_layout, p_layout, RING_WEIGHTS, TABLE_DTYPE)
            state_lo = warpgroup_mma(a_lo_smem.index(0).permute((1, 0)), psiv_smem.index(0), state_lo * decay,
                                     is_async=True)
            if STACKED:
                state_lo = warpgroup_mma_wait(0, deps=(state_lo,))
            else:
                state_hi = warpgroup_mma(a_hi_smem.index(0).permute((1, 0)), psiv_smem.index(0), state_hi * decay,
                                         is_async=True)
                state_lo, state_hi = warpgroup_mma_wait(0, deps=(state_lo, state_hi))
    if STORE_STATES:
        tma.store_wait(0)
    if STORE_END:
        # The segment's end state, fp32; the last segment's is never read.
        end_state = seg_state_ptr + (bh * N_SEGMENTS + seg) * N * P + tile
        end_mask = (rows[:, None] < N) & (cols[None, :] < P) & (seg < N_SEGMENTS - 1)
        gl.store(end_state, state_lo, mask=end_mask)
        if not STACKED:
            gl.store(end_state + HALF * P, state_hi, mask=end_mask)


@gluon.jit
def _gluon_scan_kernel(k_desc, cos_desc, sin_desc, v_desc, states_desc, da_rev_ptr, trap_scale_ptr, da_cs_ptr,
                       k_bias_ptr, psi_ptr, seg_state_ptr,
                       S, H, G, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
                       C: gl.constexpr, R: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr,
                       BLOCK_P: gl.constexpr, NUM_BUFFERS: gl.constexpr, STORE_STATES: gl.constexpr,
                       FOLD_EARLIER: gl.constexpr, STORE_END: gl.constexpr, BLOCK_SEG_CHUNKS: gl.constexpr,
                       num_warps: gl.constexpr, GDC: gl.constexpr = False, HALF_ROTATION: gl.constexpr = False,
                       STORE_BUFFERS: gl.constexpr = 1, OPERAND_BUFFERS: gl.constexpr = 1,
                       RING_WEIGHTS: gl.constexpr = False, TABLE_DTYPE: gl.constexpr = None):
    """One program scans one segment of one (b, h) for one [2 x 64, P tile] piece of its state: the production state
    scan's three roles, as its ``STORE_STATES`` / ``FOLD_EARLIER`` / ``STORE_END`` flags set them
    (``chunk_state.py``).  With a TABLE_DTYPE, ``cos_desc`` is a box of the fp32 angles and the consumer computes
    the tables' cos / sin from them (``sin_desc`` is not read)."""
    wait_for_previous_grid(GDC)
    HALF: gl.constexpr = N // 2
    BLOCK_HALF: gl.constexpr = k_desc.block_type.shape[2]
    STACKED: gl.constexpr = BLOCK_HALF < _STATE_ROWS  # N = 64: one [64, P tile] accumulator holds both halves
    P_TILES: gl.constexpr = P // BLOCK_P
    n0 = gl.program_id(0) // P_TILES * BLOCK_HALF
    pid_p = gl.program_id(0) % P_TILES
    seg = gl.program_id(1)
    bh = gl.program_id(2)
    b = bh // H
    h = bh % H
    g = h // (H // G)
    p0 = pid_p * BLOCK_P
    c_first = seg * CHUNKS_PER_SEG
    n_steps = gl.minimum(CHUNKS_PER_SEG, NCH - c_first)

    k_lo_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUFFERS] + k_desc.block_type.shape, k_desc.layout)
    k_hi_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_BUFFERS] + k_desc.block_type.shape, k_desc.layout)
    cos_bufs = gl.allocate_shared_memory(cos_desc.dtype, [NUM_BUFFERS] + cos_desc.block_type.shape, cos_desc.layout)
    FROM_ANGLES: gl.constexpr = TABLE_DTYPE is not None
    if FROM_ANGLES:
        sin_bufs = cos_bufs
    else:
        sin_bufs = gl.allocate_shared_memory(sin_desc.dtype, [NUM_BUFFERS] + sin_desc.block_type.shape,
                                             sin_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUFFERS] + v_desc.block_type.shape, v_desc.layout)
    # A stage's weight rows (RING_WEIGHTS): the chunk's da_rev and trap_scale, and its decay (da_cs's last value).
    # Shared-memory shapes are powers of two: 4 slots for a ring of 3.
    WEIGHT_SLOTS: gl.constexpr = 4 if NUM_BUFFERS > 2 else NUM_BUFFERS
    # Rows 2 * stage and 2 * stage + 1 (rank-1 layouts: a row is indexed out as a vector, as the bias rows below).
    weight_bufs = gl.allocate_shared_memory(gl.float32, [2 * WEIGHT_SLOTS, C if RING_WEIGHTS else 1],
                                            gl.SwizzledSharedLayout(1, 1, 1, [0]))
    decay_bufs = gl.allocate_shared_memory(gl.float32, [WEIGHT_SLOTS, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    # The update's operands, rows (rank, token): A = k~ per half (read transposed), B = the weighted psiv; one set,
    # or two (OPERAND_BUFFERS) so that a step's wgmma overlaps the next chunk's rotation.
    # Stacked (N = 64), one [R * C, 64] operand holds both halves side by side; a_hi_smem and out_hi_smem are not used.
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R * C, _STATE_ROWS], gl.bfloat16)
    a_lo_smem = gl.allocate_shared_memory(gl.bfloat16, [OPERAND_BUFFERS, R * C, _STATE_ROWS], a_layout)
    if STACKED:
        a_hi_smem = a_lo_smem
    else:
        a_hi_smem = gl.allocate_shared_memory(gl.bfloat16, [OPERAND_BUFFERS, R * C, _STATE_ROWS], a_layout)
    psiv_smem = gl.allocate_shared_memory(gl.bfloat16, [OPERAND_BUFFERS, R * C, BLOCK_P],
                                          gl.NVMMASharedLayout.get_default_for([R * C, BLOCK_P], gl.bfloat16))
    # STORE_BUFFERS state-store buffers a half (two where shared memory allows: no wait on the last step's store).
    store_shape: gl.constexpr = [STORE_BUFFERS] + states_desc.block_type.shape
    out_lo_smem = gl.allocate_shared_memory(states_desc.dtype, store_shape, states_desc.layout)
    if STACKED:
        out_hi_smem = out_lo_smem
    else:
        out_hi_smem = gl.allocate_shared_memory(states_desc.dtype, store_shape, states_desc.layout)

    # The head's k bias and Psi tile, read once into shared memory: a rank's row is then one shared load a chunk.
    # Rank-1 layouts: a row of the [R, cols] buffers is indexed out as a vector.
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    # The bias rows in the rotation's dtype: the consumer adds them to k as they are.
    bias_dtype: gl.constexpr = gl.bfloat16 if HALF_ROTATION else gl.float32
    bias_lo_smem = gl.allocate_shared_memory(bias_dtype, [R, BLOCK_HALF], plain)
    bias_hi_smem = gl.allocate_shared_memory(bias_dtype, [R, BLOCK_HALF], plain)
    psi_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_P], plain)
    col = n0 + gl.arange(0, BLOCK_HALF, row_layout)
    psi_col = p0 + gl.arange(0, BLOCK_P, row_layout)
    for r in gl.static_range(R):
        bias_lo_smem.index(r).store(gl.load(k_bias_ptr + (h * R + r) * N + col).to(bias_dtype))
        bias_hi_smem.index(r).store(gl.load(k_bias_ptr + (h * R + r) * N + HALF + col).to(bias_dtype))
        psi_smem.index(r).store(gl.load(psi_ptr + (h * R + r) * P + psi_col))

    gl.thread_barrier()  # the rows above are written by other threads than the consumer's readers
    gl.warp_specialize([
        (_consumer, (k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs, decay_bufs, da_rev_ptr,
                     trap_scale_ptr, ready, empty, a_lo_smem, a_hi_smem, psiv_smem, out_lo_smem, out_hi_smem,
                     bias_lo_smem, bias_hi_smem, psi_smem, states_desc, seg_state_ptr, da_cs_ptr, bh, c_first, n0, p0,
                     S, NCH, CHUNKS_PER_SEG, N_SEGMENTS, seg, n_steps, C, R, N, P, RD, BLOCK_P, STORE_STATES,
                     FOLD_EARLIER, STORE_END, BLOCK_SEG_CHUNKS, HALF_ROTATION, RING_WEIGHTS, TABLE_DTYPE,
                     num_warps)),
        (_producer, (k_desc, cos_desc, sin_desc, v_desc, k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, weight_bufs,
                     decay_bufs, da_rev_ptr, trap_scale_ptr, da_cs_ptr, ready, empty, b, h, g, bh, c_first * C, n0, p0,
                     S, n_steps, C, N, P, RD, GDC, RING_WEIGHTS, FROM_ANGLES)),
    ], [1], [PRODUCER_REGISTERS])


def shape_problems(*, B, S, R, G, N, H, P, RD, chunk_size, block_p, dtypes, store_states=True):
    """What keeps the kernel's boxes from covering this problem: a list of reasons, empty where they do, one ring
    stage within the 99 KB bound among them (``store_states``: the role stores states, whose buffers count).
    ``dtypes``: (k, the rotation tables, states)."""
    C = chunk_size
    problems = []
    if shared_bytes(C=C, R=R, block_p=block_p, num_buffers=1, N=N, store_states=store_states) + 768 > SMEM_LIMIT:
        problems.append(f"one ring stage within {SMEM_LIMIT} bytes of shared memory, got C={C}, R={R}, N={N}, "
                        f"block_p={block_p}")
    if N % (2 * BLOCK_HALF) and N != STATE_ROWS:
        # wgmma's accumulators are 64 rows: two 64-row halves, or at N = 64 both 32-row halves stacked.
        problems.append(f"N = 64 or a multiple of 128, got N={N}")
    # A swizzled box row is at most 128 bytes: 64 bf16 columns.
    if block_p not in (32, 64) or P % block_p:
        problems.append(f"a P tile of 32 or 64 dividing P, got block_p={block_p}, P={P}")
    if C % 8 or R & (R - 1) or (C * R) % 16 or C * R > 256:
        problems.append(f"C a multiple of 8, R a power of two and C * R a multiple of 16 up to 256, got C={C}, R={R}")
    if S % C:
        # A chunk's boxes would cross into the next sequence (the production scans mask partial chunks).
        problems.append(f"S a multiple of C, got S={S}, C={C}")
    if (H * RD * 2) % 16:
        problems.append(f"16-byte rows of the cos / sin tables, got H * RD = {H * RD}")
    k_dtype, table_dtype, states_dtype = dtypes
    if k_dtype != torch.bfloat16 or states_dtype != torch.bfloat16 or table_dtype not in (torch.float16,
                                                                                          torch.bfloat16):
        problems.append(f"bf16 k and states with 16-bit tables, got (k, tables, states) = {dtypes}")
    return problems


def check_shape(**problem):
    """ValueError naming every reason the kernel does not cover ``problem`` (``shape_problems``' arguments)."""
    problems = shape_problems(**problem)
    if problems:
        raise ValueError("gluon_state_scan: needs " + "; ".join(problems))


def unsupported(*, k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, trap_scale, states, chunk_size,
                block_p, angles=None, table_dtype=None, **_unused):
    """None where the kernel can run these scan arguments (``chunk_local_states``' with ``states``, the tensor the
    storing pass writes; the cos / sin tables, or ``angles`` with the ``table_dtype`` they stand for, as
    ``host_utils.rotation_source`` takes them), else the reason: a Hopper GPU outside the interpreter, contiguous
    16-byte aligned tensors, and ``shape_problems``."""
    if not k.is_cuda or knobs.runtime.interpret or torch.cuda.get_device_capability(k.device)[0] != 9:
        return "needs a Hopper GPU (wgmma, TMA) outside the Triton interpreter"
    trig = rotation_source("gluon_state_scan", k, cos_angles, sin_angles, angles, table_dtype)
    tensors = dict(k=k, v=v, cos_angles=trig["cos_angles"], sin_angles=trig["sin_angles"], k_bias=k_bias,
                   mimo_v=mimo_v, da_cs=da_cs, da_cs_rev=da_cs_rev, trap_scale=trap_scale, states=states)
    for name, tensor in tensors.items():
        if not tensor.is_contiguous() or tensor.data_ptr() % 16:
            return f"needs {name} contiguous and 16-byte aligned"
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    problems = shape_problems(B=B, S=S, R=R, G=G, N=N, H=H, P=P, RD=trig["RD"], chunk_size=chunk_size,
                              block_p=block_p, dtypes=(k.dtype, trig["table_dtype"], states.dtype))
    return "; ".join(problems) or None


def descriptors(*, k, v, cos_angles, sin_angles, states, chunk_size, block_p, angles=None, q=None):
    """The kernel's TMA descriptors (host-side, so no program builds one).  With ``angles`` (cos_angles and
    sin_angles None), cos_desc and sin_desc are both one box of the fp32 angles.  With ``q`` (shaped as k), also
    ``q_desc``, q's boxes as k's (``gluon_scan_outputs``)."""
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    RD = (cos_angles if angles is None else angles).shape[3]
    C, HALF = chunk_size, half_columns(N)
    nch = states.shape[2]
    states_rows = states.shape[0] * states.shape[1] * nch * states.shape[3]

    def box(tensor, shape, strides, block, layout=None):
        element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[tensor.dtype]
        layout = layout or gl.NVMMASharedLayout.get_default_for(block, element)
        return TensorDescriptor(tensor, list(shape), list(strides), list(block), layout)

    if angles is None:
        cos_desc = box(cos_angles, [B * S, H * RD], [H * RD, 1], [C, HALF])
        sin_desc = box(sin_angles, [B * S, H * RD], [H * RD, 1], [C, HALF])
    else:
        # 64 fp32 columns are 256-byte rows, past the 128-byte swizzle: unswizzled (the consumer reads a row a warp,
        # which is conflict-free without it).
        cos_desc = sin_desc = box(angles, [B * S, H * RD], [H * RD, 1], [C, HALF],
                                  gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    found = dict(
        # k viewed as [R, B * S, G * N]: a box is one chunk's rows, rank-major.
        k_desc=box(k, [R, B * S, G * N], [G * N, R * G * N, 1], [R, C, HALF]),
        cos_desc=cos_desc,
        sin_desc=sin_desc,
        v_desc=box(v, [B * S, H * P], [H * P, 1], [C, block_p]),
        states_desc=box(states, [states_rows, states.shape[4]], [states.shape[4], 1], [STATE_ROWS, block_p]),
    )
    if q is not None:
        found["q_desc"] = box(q, [R, B * S, G * N], [G * N, R * G * N, 1], [R, C, HALF])
    return found


ROLES = {
    # role: (STORE_STATES, FOLD_EARLIER, STORE_END), as the production wrappers of chunk_state.py set them.
    "local": (True, False, True),  # chunk_local_states
    "end": (False, False, True),  # segment_end_states
    "store": (True, True, False),  # chunk_states
}


def _launch(*, role, k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, trap_scale, states, seg_state,
            chunk_size, n_segments, chunks_per_segment, block_p, num_buffers, segments_launched, max_registers=0,
            rotation_math_dtype=tl.float32, store_buffers=None, operand_buffers=None, angles=None, table_dtype=None,
            **_unused):
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    trig = rotation_source("gluon_state_scan", k, cos_angles, sin_angles, angles, table_dtype)
    RD = trig["RD"]
    store_states, fold_earlier, store_end = ROLES[role]
    check_shape(B=B, S=S, R=R, G=G, N=N, H=H, P=P, RD=RD, chunk_size=chunk_size, block_p=block_p,
                dtypes=(k.dtype, trig["table_dtype"], states.dtype), store_states=store_states)
    num_buffers, operand_buffers, store_buffers = buffer_plan(
        C=chunk_size, R=R, block_p=block_p, N=N, store_states=store_states, num_buffers=num_buffers,
        operand_buffers=operand_buffers, store_buffers=store_buffers)
    found = descriptors(k=k, v=v, cos_angles=cos_angles, sin_angles=sin_angles, states=states,
                        chunk_size=chunk_size, block_p=block_p, angles=angles)
    # Through ops/launch.py, so that a whole call's launches replay (descriptors rebuilt around the new tensors).
    # 5 warps are 8 on the hardware (whole warpgroups): 128 registers a thread keeps two programs an SM, and the
    # producer's 40 leave the consumer warpgroup 232 (at a cap of 64: 104).  ``max_registers`` (the production
    # scans' ScanConfig.scan_max_registers) lowers the cap, never raises it.
    launch(_gluon_scan_kernel, (max(1, N // 2 // BLOCK_HALF) * (P // block_p), segments_launched, B * H),
           found["k_desc"], found["cos_desc"], found["sin_desc"], found["v_desc"], found["states_desc"],
           da_cs_rev, trap_scale, da_cs, k_bias, mimo_v, seg_state,
           S, H, G, cdiv(S, chunk_size), chunks_per_segment, n_segments,
           C=chunk_size, R=R, N=N, P=P, RD=RD, BLOCK_P=block_p,
           NUM_BUFFERS=num_buffers, STORE_BUFFERS=store_buffers, OPERAND_BUFFERS=operand_buffers,
           RING_WEIGHTS=ring_weights(C=chunk_size, N=N, P=P, block_p=block_p),
           STORE_STATES=store_states, FOLD_EARLIER=fold_earlier, STORE_END=store_end,
           BLOCK_SEG_CHUNKS=triton.next_power_of_2(chunks_per_segment), num_warps=4,
           maxnreg=min(MAX_REGISTERS, max_registers) if max_registers else MAX_REGISTERS,
           HALF_ROTATION=rotation_math_dtype != tl.float32,
           **({"TABLE_DTYPE": trig["TABLE_DTYPE"]} if trig["FROM_ANGLES"] else {}))


def _segment_scratch(k, v, n_segments):
    B, _, _, _, N = k.shape
    return torch.empty((B, v.shape[2], n_segments, N, v.shape[3]), device=k.device, dtype=torch.float32)


def gluon_chunk_local_states(*, states, n_segments, seg_state=None, num_buffers=None, **scan):
    """``chunk_local_states`` through the Gluon kernel: the same arguments (those it has no use for are ignored;
    one chunk a step; ``max_registers`` can only lower its cap of 128) plus ``num_buffers``, the depth of the
    shared-memory ring (default: the deepest of 1-3 within 99 KB, ``ring_depth``; the state-store buffers, one or
    two, then take what fits: ``state_store_buffers``), and ``seg_state`` to write into (default: a new one).
    ``states`` [B, H, nch, N, P] bf16 receives the segment-local states.  Returns seg_state [B, H, n_segments, N, P]
    fp32 (end states)."""
    seg_state = _segment_scratch(scan["k"], scan["v"], n_segments) if seg_state is None else seg_state
    _launch(role="local", states=states, seg_state=seg_state, n_segments=n_segments, num_buffers=num_buffers,
            segments_launched=n_segments, **scan)
    return seg_state


@functools.lru_cache(maxsize=None)
def _unused_states(device, block_p):
    """A one-box bf16 tensor standing in for the states descriptor where no state is stored (made once)."""
    return torch.empty((1, 1, 1, STATE_ROWS, block_p), device=device, dtype=torch.bfloat16)


def gluon_segment_end_states(*, n_segments, seg_state=None, num_buffers=None, **scan):
    """``segment_end_states`` through the Gluon kernel (one chunk a step): every segment but the last scanned from
    zero, its end state written.  Returns seg_state [B, H, n_segments, N, P] fp32, or None with one segment."""
    if n_segments == 1:
        return None
    seg_state = _segment_scratch(scan["k"], scan["v"], n_segments) if seg_state is None else seg_state
    _launch(role="end", states=_unused_states(scan["k"].device, scan["block_p"]), seg_state=seg_state,
            n_segments=n_segments, num_buffers=num_buffers,
            segments_launched=n_segments - 1, **scan)
    return seg_state


def gluon_chunk_states(*, seg_state, states, n_segments, num_buffers=None, **scan):
    """``chunk_states`` through the Gluon kernel: each segment folds the earlier segments' end states (from
    ``gluon_segment_end_states`` or ``segment_end_states``, None with one segment) and stores the state entering
    each of its chunks into ``states`` [B, H, nch, N, P] bf16."""
    _launch(role="store", states=states, seg_state=scan["trap_scale"] if seg_state is None else seg_state,
            n_segments=n_segments, num_buffers=num_buffers, segments_launched=n_segments, **scan)


def shared_bytes(*, C, R, block_p, num_buffers, N=128, store_states=True, store_buffers=1, operand_buffers=1,
                 ring_weights=None):
    """The kernel's shared memory, the same for any N of 128 or more (a program holds a [2 x 64, P tile] piece; at
    N = 64 [2 x 32, P tile], half the k, table, operand and store bytes): the ring's stages plus the update's
    operands (one set or two), the bias / Psi rows (the bias counted in fp32: under the bf16 rotation it takes half),
    the stages' weight rows (``ring_weights``, default ``RING_WEIGHTS``) and, where it stores states, the state-store
    buffers (the compiler adds barriers and alignment: 236-268 bytes more on the official shapes)."""
    half = half_columns(N)
    stage = 2 * R * C * half * 2 + 2 * C * half * 2 + C * block_p * 2
    operands = 2 * R * C * half * 2 + R * C * block_p * 2
    fixed = operand_buffers * operands + 2 * R * half * 4 + R * block_p * 4
    if RING_WEIGHTS if ring_weights is None else ring_weights:
        slots = 4 if num_buffers > 2 else num_buffers  # a power of two
        fixed += slots * (2 * C + 1) * 4
    return fixed + num_buffers * stage + (store_buffers * 2 * half * block_p * 2 if store_states else 0)


def ring_weights(*, C, N, P, block_p):
    """Whether a launch's chunk weights ride the ring (``RING_WEIGHTS`` allowing): with chunks of at most 16 rows,
    except over several P tiles at N >= 128.  Timed per official shape on the H100 (section 49), the scan took
    4-13% less there (N64_P64 47 -> 43 us, N128_P32 55 -> 48, R8_C8 136 -> 127, N256 270 -> 256) and more elsewhere:
    N128_P128 262 -> 284, R2_C32 43 -> 45 and R1_C64 30 -> 32 (rings of 2 and 1 stage, chunks of 32 and 64 rows).
    The weight rows count in ``shared_bytes`` either way, so the ring plan does not depend on this choice."""
    return RING_WEIGHTS and C <= 16 and not (N >= 128 and P > block_p)


def ring_depth(*, C, R, block_p, N=128, store_states=True):
    """The deepest ring (1 to 3 stages) whose shared memory stays within the 99 KB bound, with 768 bytes for
    what the model leaves out."""
    return max([1] + [depth for depth in (2, 3) if shared_bytes(C=C, R=R, block_p=block_p, num_buffers=depth, N=N,
                                                                store_states=store_states) + 768 <= SMEM_LIMIT])


def update_operand_buffers(*, C, R, block_p, N=128, num_buffers, store_states=True, most=None):
    """Sets of update operands: two where ``most`` (default ``MAX_OPERAND_BUFFERS``) allows them and they fit beside
    a ring of ``num_buffers`` stages (at least two: the ring keeps its depth first) and one state-store buffer within
    the 99 KB bound (with ``ring_depth``'s 768 bytes of slack), else one."""
    most = MAX_OPERAND_BUFFERS if most is None else most
    two_fit = shared_bytes(C=C, R=R, block_p=block_p, num_buffers=num_buffers, N=N, store_states=store_states,
                           operand_buffers=2) + 768 <= SMEM_LIMIT
    return 2 if most >= 2 and num_buffers >= 2 and two_fit else 1


def state_store_buffers(*, C, R, block_p, N=128, num_buffers, store_states=True, most=None, operand_buffers=1):
    """State-store buffers a half: two where ``most`` (default ``MAX_STATE_STORE_BUFFERS``) allows them and they fit
    beside the ring of ``num_buffers`` stages and the ``operand_buffers`` sets of operands within the 99 KB bound
    (with ``ring_depth``'s 768 bytes of slack; the ring and then the operands keep theirs first), else one."""
    most = MAX_STATE_STORE_BUFFERS if most is None else most
    two_fit = shared_bytes(C=C, R=R, block_p=block_p, num_buffers=num_buffers, N=N, store_buffers=2,
                           operand_buffers=operand_buffers) + 768 <= SMEM_LIMIT
    return 2 if store_states and most >= 2 and two_fit else 1


def buffer_plan(*, C, R, block_p, N=128, store_states=True, num_buffers=None, operand_buffers=None,
                store_buffers=None):
    """(ring stages, sets of update operands, state-store buffers) of a launch: each one given, else chosen in that
    order, each taking what fits beside the ones before it (``ring_depth``, ``update_operand_buffers``,
    ``state_store_buffers``)."""
    num_buffers = num_buffers or ring_depth(C=C, R=R, block_p=block_p, N=N, store_states=store_states)
    if operand_buffers is None:
        operand_buffers = update_operand_buffers(C=C, R=R, block_p=block_p, N=N, num_buffers=num_buffers,
                                                 store_states=store_states)
    if store_buffers is None:
        store_buffers = state_store_buffers(C=C, R=R, block_p=block_p, N=N, num_buffers=num_buffers,
                                            store_states=store_states, operand_buffers=operand_buffers)
    return num_buffers, operand_buffers, store_buffers
