"""Probe: the local-state scan as a warp-specialized Gluon kernel (TMA producer warp, wgmma consumer warpgroup).

    python benchmarks/gluon_scan_probe.py --compile-only   # no GPU: resources, register split, chunk-loop SASS
    python benchmarks/gluon_scan_probe.py                  # Hopper GPU: check against chunk_local_states, time both

Not a production kernel.  It asks whether the route docs/optimization.md section 32 left open reaches the state
scans: Triton's ``tl`` gave no producer / consumer split (``tma_scan_probe.py``), and the scans wait on their loads
(28-35% of their issue rate, section 31).  Gluon (``triton.experimental.gluon``, in Triton 3.6) states the split
itself:

- a 1-warp producer partition (40 registers) streams each chunk's tiles into a ring of ``num_buffers`` shared-memory
  stages with TMA: k as two [R, C, N/2] boxes (k viewed as [R, B * S, G * N], so a chunk's rows land rank-major and
  every rank's [C, N/2] block shares its tokens' tiles), cos / sin as [C, N/2] boxes, v as a [C, P tile] box and the
  three per-token vectors (da_cs_rev, trap_scale, da_cs) as [C] boxes;
- the 4-warp consumer partition (the default one, up to 232 registers) rotates k, weighs v, writes the update's two
  operands to shared memory, stores the entering state through shared memory with an asynchronous TMA store, and
  runs ``state = decay * state + k~^T @ psiv`` as two wgmma (one per N/2 half, [N/2, P tile] fp32 accumulators).

It computes what ``chunk_local_states`` computes (bf16 activations and states, fp16 rotation tables, the fp32
rotation, one chunk a step), for the shapes its boxes cover: N = 128 (N/2 = 64: one 128-byte swizzled box row),
P a multiple of the P tile (32 or 64), C * R a multiple of 16 and at most 256, C a multiple of 8, and S a
multiple of C (the API pads every call to whole chunks, so boxes never cross a sequence end).  Six of the eleven
official shapes qualify.  Gluon kernels do not run in the Triton interpreter: the value check runs on a Hopper GPU
only (``tests/test_gluon_scan_probe.py``); on the CPU the test compiles the kernel for sm_90 and checks its
partitioning and its shared memory.
"""

import argparse
import collections
import itertools
import json
import os
import re
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tma_scan_probe import max_relative_error, scan_arguments  # noqa: E402

from mamba3_mimo.bench import parse_case  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.ops.chunk_state import chunk_local_states  # noqa: E402
from mamba3_mimo.ops.host_utils import cdiv  # noqa: E402
from mamba3_mimo.ops.production import choose_config  # noqa: E402

SMEM_LIMIT = 101_376  # the project's per-launch shared-memory bound (99 KB)
BLOCK_HALF = 64  # columns of each N/2 half a program holds: one 128-byte swizzled bf16 box row

PRODUCER_REGISTERS = gl.constexpr(40)


@gluon.constexpr_function
def _rows_layout(cols, num_warps):
    """[rows, cols] elementwise tiles: a warp's lanes across the columns, the warps down the rows."""
    lanes = min(32, cols)
    return gl.BlockedLayout([1, max(1, cols // 32)], [32 // lanes, lanes], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _state_layout(block_p, num_warps):
    """The wgmma accumulator of one [N/2, P tile] state half."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_p, 16])


@gluon.jit
def _producer(k_desc, cos_desc, sin_desc, v_desc, da_rev_desc, trap_scale_desc, da_cs_desc,
              k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, da_rev_bufs, trap_scale_bufs, da_cs_bufs,
              ready, empty, b, h, g, bh, t_first, n0, p0, S, n_steps,
              C: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr):
    HALF: gl.constexpr = N // 2
    NUM_BUFFERS: gl.constexpr = k_lo_bufs.type.shape[0]
    STEP_BYTES: gl.constexpr = (2 * k_desc.block_type.nbytes + 2 * cos_desc.block_type.nbytes
                                + v_desc.block_type.nbytes + da_rev_desc.block_type.nbytes
                                + trap_scale_desc.block_type.nbytes + da_cs_desc.block_type.nbytes)
    for i in range(n_steps):
        stage = i % NUM_BUFFERS
        # A fresh mbarrier counts as having completed phase 1, so the first pass through the ring does not wait.
        mbarrier.wait(empty.index(stage), ((i // NUM_BUFFERS) & 1) ^ 1)
        row = b * S + t_first + i * C
        bar = ready.index(stage)
        mbarrier.expect(bar, STEP_BYTES)
        tma.async_copy_global_to_shared(k_desc, [0, row, g * N + n0], bar, k_lo_bufs.index(stage))
        tma.async_copy_global_to_shared(k_desc, [0, row, g * N + HALF + n0], bar, k_hi_bufs.index(stage))
        tma.async_copy_global_to_shared(cos_desc, [row, h * RD + n0], bar, cos_bufs.index(stage))
        tma.async_copy_global_to_shared(sin_desc, [row, h * RD + n0], bar, sin_bufs.index(stage))
        tma.async_copy_global_to_shared(v_desc, [row, h * P + p0], bar, v_bufs.index(stage))
        tma.async_copy_global_to_shared(da_rev_desc, [bh * S + t_first + i * C], bar, da_rev_bufs.index(stage))
        tma.async_copy_global_to_shared(trap_scale_desc, [bh * S + t_first + i * C], bar,
                                        trap_scale_bufs.index(stage))
        tma.async_copy_global_to_shared(da_cs_desc, [bh * S + t_first + i * C], bar, da_cs_bufs.index(stage))


@gluon.jit
def _consumer(k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, da_rev_bufs, trap_scale_bufs, da_cs_bufs,
              ready, empty, a_lo_smem, a_hi_smem, psiv_smem, out_lo_smem, out_hi_smem, bias_lo_smem, bias_hi_smem,
              psi_smem, states_desc, seg_state_ptr, da_cs_ptr, bh, c_first, n0, p0, S, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
              seg, n_steps, C: gl.constexpr, R: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr,
              BLOCK_P: gl.constexpr, STORE_STATES: gl.constexpr, FOLD_EARLIER: gl.constexpr,
              STORE_END: gl.constexpr, BLOCK_SEG_CHUNKS: gl.constexpr, num_warps: gl.constexpr):
    HALF: gl.constexpr = N // 2
    BLOCK_HALF: gl.constexpr = a_lo_smem.type.shape[1]
    NUM_BUFFERS: gl.constexpr = k_lo_bufs.type.shape[0]
    k_layout: gl.constexpr = _rows_layout(BLOCK_HALF, num_warps)
    p_layout: gl.constexpr = _rows_layout(BLOCK_P, num_warps)
    acc_layout: gl.constexpr = _state_layout(BLOCK_P, num_warps)
    token_layout: gl.constexpr = gl.SliceLayout(1, p_layout)
    scalar_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])

    # Columns past RD are not rotated; their boxes hold the next head's angles (zeros past the table's end).
    rotated = (n0 + gl.arange(0, BLOCK_HALF, gl.SliceLayout(0, k_layout)) < RD)[None, :]
    rows = n0 + gl.arange(0, BLOCK_HALF, gl.SliceLayout(1, acc_layout))
    cols = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, acc_layout))
    tile = rows[:, None] * P + cols[None, :]
    state_lo = gl.zeros([BLOCK_HALF, BLOCK_P], gl.float32, acc_layout)
    state_hi = gl.zeros([BLOCK_HALF, BLOCK_P], gl.float32, acc_layout)
    if FOLD_EARLIER:
        # The storing pass of two: s <- exp(segment log decay) s + end state, over the earlier segments.
        chunk = gl.arange(0, BLOCK_SEG_CHUNKS, scalar_layout)
        for earlier in range(0, seg):
            chunk_ends = (earlier * CHUNKS_PER_SEG + chunk) * C + C - 1
            segment_decay = gl.exp(gl.sum(gl.load(da_cs_ptr + bh * S + chunk_ends, mask=chunk < CHUNKS_PER_SEG,
                                                  other=0.0), axis=0))
            end_state = seg_state_ptr + (bh * N_SEGMENTS + earlier) * N * P + tile
            state_lo = state_lo * segment_decay + gl.load(end_state)
            state_hi = state_hi * segment_decay + gl.load(end_state + HALF * P)
    for i in range(n_steps):
        stage = i % NUM_BUFFERS
        c = c_first + i
        if STORE_STATES:
            # The state entering chunk c goes out through shared memory as an asynchronous TMA store; the previous
            # chunk's store has had a whole step to finish reading its buffers.
            tma.store_wait(0)
            out_lo_smem.store(state_lo.to(gl.bfloat16))
            out_hi_smem.store(state_hi.to(gl.bfloat16))
            fence_async_shared()
            tma.async_copy_shared_to_global(states_desc, [(bh * NCH + c) * N + n0, p0], out_lo_smem)
            tma.async_copy_shared_to_global(states_desc, [(bh * NCH + c) * N + HALF + n0, p0], out_hi_smem)

        mbarrier.wait(ready.index(stage), (i // NUM_BUFFERS) & 1)
        # da_cs is chunk-local: its value at the chunk's last token is the chunk's whole log decay.
        decay = gl.exp(gl.sum(da_cs_bufs.index(stage).slice(C - 1, 1).load(scalar_layout), axis=0))
        weight = gl.exp(da_rev_bufs.index(stage).load(token_layout)) * trap_scale_bufs.index(stage).load(token_layout)
        cos = gl.where(rotated, cos_bufs.index(stage).load(k_layout).to(gl.float32), 1.0)
        sin = gl.where(rotated, sin_bufs.index(stage).load(k_layout).to(gl.float32), 0.0)
        v_weighted = v_bufs.index(stage).load(p_layout).to(gl.float32) * weight[:, None]
        k_lo_rows = k_lo_bufs.index(stage).reshape([R * C, BLOCK_HALF])
        k_hi_rows = k_hi_bufs.index(stage).reshape([R * C, BLOCK_HALF])
        for r in gl.static_range(R):
            k_lo = k_lo_rows.slice(r * C, C).load(k_layout).to(gl.float32) + bias_lo_smem.index(r).load(
                gl.SliceLayout(0, k_layout))[None, :]
            k_hi = k_hi_rows.slice(r * C, C).load(k_layout).to(gl.float32) + bias_hi_smem.index(r).load(
                gl.SliceLayout(0, k_layout))[None, :]
            a_lo_smem.slice(r * C, C).store((cos * k_lo - sin * k_hi).to(gl.bfloat16))
            a_hi_smem.slice(r * C, C).store((sin * k_lo + cos * k_hi).to(gl.bfloat16))
            psi = psi_smem.index(r).load(gl.SliceLayout(0, p_layout))
            psiv_smem.slice(r * C, C).store((v_weighted * psi[None, :]).to(gl.bfloat16))
        # Orders this partition's shared-memory reads and writes before the producer's next TMA into the stage and
        # before the wgmma reads of the operands.
        fence_async_shared()
        mbarrier.arrive(empty.index(stage), count=1)
        state_lo = warpgroup_mma(a_lo_smem.permute((1, 0)), psiv_smem, state_lo * decay, is_async=True)
        state_hi = warpgroup_mma(a_hi_smem.permute((1, 0)), psiv_smem, state_hi * decay, is_async=True)
        state_lo, state_hi = warpgroup_mma_wait(0, deps=(state_lo, state_hi))
    if STORE_STATES:
        tma.store_wait(0)
    if STORE_END:
        # The segment's end state, fp32; the last segment's is never read.
        end_state = seg_state_ptr + (bh * N_SEGMENTS + seg) * N * P + tile
        end_mask = (rows[:, None] < N) & (cols[None, :] < P) & (seg < N_SEGMENTS - 1)
        gl.store(end_state, state_lo, mask=end_mask)
        gl.store(end_state + HALF * P, state_hi, mask=end_mask)


@gluon.jit
def _gluon_scan_kernel(k_desc, cos_desc, sin_desc, v_desc, da_rev_desc, trap_scale_desc, da_cs_desc, states_desc,
                       k_bias_ptr, psi_ptr, seg_state_ptr, da_cs_ptr,
                       S, H, G, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
                       C: gl.constexpr, R: gl.constexpr, N: gl.constexpr, P: gl.constexpr, RD: gl.constexpr,
                       BLOCK_P: gl.constexpr, NUM_BUFFERS: gl.constexpr, STORE_STATES: gl.constexpr,
                       FOLD_EARLIER: gl.constexpr, STORE_END: gl.constexpr, BLOCK_SEG_CHUNKS: gl.constexpr,
                       num_warps: gl.constexpr):
    """One program scans one segment of one (b, h) for one [2 x 64, P tile] piece of its state: the production state
    scan's three roles, as its ``STORE_STATES`` / ``FOLD_EARLIER`` / ``STORE_END`` flags set them
    (``chunk_state.py``)."""
    HALF: gl.constexpr = N // 2
    BLOCK_HALF: gl.constexpr = k_desc.block_type.shape[2]
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
    sin_bufs = gl.allocate_shared_memory(sin_desc.dtype, [NUM_BUFFERS] + sin_desc.block_type.shape, sin_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUFFERS] + v_desc.block_type.shape, v_desc.layout)
    da_rev_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, C], da_rev_desc.layout)
    trap_scale_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, C], trap_scale_desc.layout)
    da_cs_bufs = gl.allocate_shared_memory(gl.float32, [NUM_BUFFERS, C], da_cs_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)

    # The update's operands, rows (rank, token): A = k~ per half (read transposed), B = the weighted psiv.
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R * C, BLOCK_HALF], gl.bfloat16)
    a_lo_smem = gl.allocate_shared_memory(gl.bfloat16, [R * C, BLOCK_HALF], a_layout)
    a_hi_smem = gl.allocate_shared_memory(gl.bfloat16, [R * C, BLOCK_HALF], a_layout)
    psiv_smem = gl.allocate_shared_memory(gl.bfloat16, [R * C, BLOCK_P],
                                          gl.NVMMASharedLayout.get_default_for([R * C, BLOCK_P], gl.bfloat16))
    out_lo_smem = gl.allocate_shared_memory(states_desc.dtype, states_desc.block_type.shape, states_desc.layout)
    out_hi_smem = gl.allocate_shared_memory(states_desc.dtype, states_desc.block_type.shape, states_desc.layout)

    # The head's k bias and Psi tile, read once into shared memory: a rank's row is then one shared load a chunk.
    # Rank-1 layouts: a row of the [R, cols] buffers is indexed out as a vector.
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    bias_lo_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_HALF], plain)
    bias_hi_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_HALF], plain)
    psi_smem = gl.allocate_shared_memory(gl.float32, [R, BLOCK_P], plain)
    col = n0 + gl.arange(0, BLOCK_HALF, row_layout)
    psi_col = p0 + gl.arange(0, BLOCK_P, row_layout)
    for r in gl.static_range(R):
        bias_lo_smem.index(r).store(gl.load(k_bias_ptr + (h * R + r) * N + col))
        bias_hi_smem.index(r).store(gl.load(k_bias_ptr + (h * R + r) * N + HALF + col))
        psi_smem.index(r).store(gl.load(psi_ptr + (h * R + r) * P + psi_col))

    gl.thread_barrier()  # the rows above are written by other threads than the consumer's readers
    gl.warp_specialize([
        (_consumer, (k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, da_rev_bufs, trap_scale_bufs, da_cs_bufs,
                     ready, empty, a_lo_smem, a_hi_smem, psiv_smem, out_lo_smem, out_hi_smem, bias_lo_smem,
                     bias_hi_smem, psi_smem, states_desc, seg_state_ptr, da_cs_ptr, bh, c_first, n0, p0, S, NCH,
                     CHUNKS_PER_SEG, N_SEGMENTS, seg, n_steps, C, R, N, P, RD, BLOCK_P, STORE_STATES, FOLD_EARLIER,
                     STORE_END, BLOCK_SEG_CHUNKS, num_warps)),
        (_producer, (k_desc, cos_desc, sin_desc, v_desc, da_rev_desc, trap_scale_desc, da_cs_desc,
                     k_lo_bufs, k_hi_bufs, cos_bufs, sin_bufs, v_bufs, da_rev_bufs, trap_scale_bufs, da_cs_bufs,
                     ready, empty, b, h, g, bh, c_first * C, n0, p0, S, n_steps, C, N, P, RD)),
    ], [1], [PRODUCER_REGISTERS])


def check_shape(*, B, S, R, G, N, H, P, RD, chunk_size, block_p, dtypes):
    """ValueError unless the probe's boxes cover this problem (see the module docstring)."""
    C = chunk_size
    problems = []
    if N % (2 * BLOCK_HALF):
        problems.append(f"N a multiple of 128 (64-column boxes of each half), got N={N}")
    # A swizzled box row is at most 128 bytes: 64 bf16 columns.
    if block_p not in (32, 64) or P % block_p:
        problems.append(f"a P tile of 32 or 64 dividing P, got block_p={block_p}, P={P}")
    if C % 8 or R & (R - 1) or (C * R) % 16 or C * R > 256:
        problems.append(f"C a multiple of 8, R a power of two and C * R a multiple of 16 up to 256, got C={C}, R={R}")
    if S % C:
        problems.append(f"S a multiple of C (whole chunks, as the API pads them), got S={S}, C={C}")
    if (H * RD * 2) % 16:
        problems.append(f"16-byte rows of the cos / sin tables, got H * RD = {H * RD}")
    if dtypes != (torch.bfloat16, torch.float16, torch.bfloat16):
        problems.append(f"bf16 activations and states with fp16 tables, got (k, tables, states) = {dtypes}")
    if problems:
        raise ValueError("gluon scan probe: needs " + "; ".join(problems))


def descriptors(*, k, v, cos_angles, sin_angles, da_cs, da_cs_rev, trap_scale, states, chunk_size, block_p):
    """The kernel's TMA descriptors (host-side, so no program builds one)."""
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    RD = cos_angles.shape[3]
    C, HALF = chunk_size, BLOCK_HALF
    nch = states.shape[2]
    states_rows = states.shape[0] * states.shape[1] * nch * states.shape[3]

    def box(tensor, shape, strides, block):
        element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[tensor.dtype]
        layout = (gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1) if len(block) == 1
                  else gl.NVMMASharedLayout.get_default_for(block, element))
        return TensorDescriptor(tensor, list(shape), list(strides), list(block), layout)

    vector = dict(shape=[B * H * S], strides=[1], block=[C])
    return dict(
        # k viewed as [R, B * S, G * N]: a box is one chunk's rows, rank-major.
        k_desc=box(k, [R, B * S, G * N], [G * N, R * G * N, 1], [R, C, HALF]),
        cos_desc=box(cos_angles, [B * S, H * RD], [H * RD, 1], [C, HALF]),
        sin_desc=box(sin_angles, [B * S, H * RD], [H * RD, 1], [C, HALF]),
        v_desc=box(v, [B * S, H * P], [H * P, 1], [C, block_p]),
        da_rev_desc=box(da_cs_rev, **vector), trap_scale_desc=box(trap_scale, **vector),
        da_cs_desc=box(da_cs, **vector),
        states_desc=box(states, [states_rows, states.shape[4]], [states.shape[4], 1], [HALF, block_p]),
    )


ROLES = {
    # role: (STORE_STATES, FOLD_EARLIER, STORE_END), as the production wrappers of chunk_state.py set them.
    "local": (True, False, True),  # chunk_local_states
    "end": (False, False, True),  # segment_end_states
    "store": (True, True, False),  # chunk_states
}


def _launch(*, role, k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, trap_scale, states, seg_state,
            chunk_size, n_segments, chunks_per_segment, block_p, num_buffers, segments_launched, **_unused):
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    RD = cos_angles.shape[3]
    check_shape(B=B, S=S, R=R, G=G, N=N, H=H, P=P, RD=RD, chunk_size=chunk_size, block_p=block_p,
                dtypes=(k.dtype, cos_angles.dtype, states.dtype))
    store_states, fold_earlier, store_end = ROLES[role]
    found = descriptors(k=k, v=v, cos_angles=cos_angles, sin_angles=sin_angles, da_cs=da_cs, da_cs_rev=da_cs_rev,
                        trap_scale=trap_scale, states=states, chunk_size=chunk_size, block_p=block_p)
    # 5 warps are 8 on the hardware (whole warpgroups): 128 registers a thread keeps two programs an SM, and the
    # producer's 40 leave the consumer warpgroup 232.
    _gluon_scan_kernel[(N // 2 // BLOCK_HALF * (P // block_p), segments_launched, B * H)](
        **found, k_bias_ptr=k_bias, psi_ptr=mimo_v, seg_state_ptr=seg_state, da_cs_ptr=da_cs,
        S=S, H=H, G=G, NCH=cdiv(S, chunk_size), CHUNKS_PER_SEG=chunks_per_segment, N_SEGMENTS=n_segments,
        C=chunk_size, R=R, N=N, P=P, RD=RD, BLOCK_P=block_p,
        NUM_BUFFERS=num_buffers or ring_depth(C=chunk_size, R=R, N=N, block_p=block_p, store_states=store_states),
        STORE_STATES=store_states, FOLD_EARLIER=fold_earlier, STORE_END=store_end,
        BLOCK_SEG_CHUNKS=triton.next_power_of_2(chunks_per_segment), num_warps=4, maxnreg=128)


def _segment_scratch(k, v, n_segments):
    B, _, _, _, N = k.shape
    return torch.empty((B, v.shape[2], n_segments, N, v.shape[3]), device=k.device, dtype=torch.float32)


def gluon_chunk_local_states(*, states, n_segments, seg_state=None, num_buffers=None, **scan):
    """``chunk_local_states`` through the Gluon kernel: the same arguments (those it has no use for are ignored;
    one chunk a step) plus ``num_buffers``, the depth of the shared-memory ring (default: the deepest of 1-3 within
    99 KB, ``ring_depth``), and ``seg_state`` to write into (default: a new one).  ``states`` [B, H, nch, N, P] bf16
    receives the segment-local states.  Returns seg_state [B, H, n_segments, N, P] fp32 (end states)."""
    seg_state = _segment_scratch(scan["k"], scan["v"], n_segments) if seg_state is None else seg_state
    _launch(role="local", states=states, seg_state=seg_state, n_segments=n_segments, num_buffers=num_buffers,
            segments_launched=n_segments, **scan)
    return seg_state


def gluon_segment_end_states(*, n_segments, seg_state=None, num_buffers=None, **scan):
    """``segment_end_states`` through the Gluon kernel (one chunk a step): every segment but the last scanned from
    zero, its end state written.  Returns seg_state [B, H, n_segments, N, P] fp32, or None with one segment."""
    if n_segments == 1:
        return None
    seg_state = _segment_scratch(scan["k"], scan["v"], n_segments) if seg_state is None else seg_state
    # No state is stored: a one-box bf16 tensor stands in for the states descriptor.
    unused = torch.empty((1, 1, 1, BLOCK_HALF, scan["block_p"]), device=scan["k"].device, dtype=torch.bfloat16)
    _launch(role="end", states=unused, seg_state=seg_state, n_segments=n_segments, num_buffers=num_buffers,
            segments_launched=n_segments - 1, **scan)
    return seg_state


def gluon_chunk_states(*, seg_state, states, n_segments, num_buffers=None, **scan):
    """``chunk_states`` through the Gluon kernel: each segment folds the earlier segments' end states (from
    ``gluon_segment_end_states`` or ``segment_end_states``, None with one segment) and stores the state entering
    each of its chunks into ``states`` [B, H, nch, N, P] bf16."""
    _launch(role="store", states=states, seg_state=scan["trap_scale"] if seg_state is None else seg_state,
            n_segments=n_segments, num_buffers=num_buffers, segments_launched=n_segments, **scan)


def shared_bytes(*, C, R, N, block_p, num_buffers, store_states=True):
    """The probe's shared memory: the ring's stages plus the update's operands, the bias / Psi rows and, where it
    stores states, the two state-store buffers (the compiler adds barriers and alignment: 410-580 bytes more on the
    official shapes)."""
    half = BLOCK_HALF
    stage = 2 * R * C * half * 2 + 2 * C * half * 2 + C * block_p * 2 + 3 * C * 4
    fixed = 2 * R * C * half * 2 + R * C * block_p * 2 + 2 * R * half * 4 + R * block_p * 4
    return fixed + num_buffers * stage + (2 * half * block_p * 2 if store_states else 0)


def ring_depth(*, C, R, N, block_p, store_states=True):
    """The deepest ring (1 to 3 stages) whose shared memory stays within the 99 KB bound, with 768 bytes for
    what the model leaves out."""
    return max([1] + [depth for depth in (2, 3) if shared_bytes(C=C, R=R, N=N, block_p=block_p, num_buffers=depth,
                                                                store_states=store_states) + 768 <= SMEM_LIMIT])


def compile_for_sm90(case, *, role="local", block_p=None, num_buffers=None, chunks_per_segment=32):
    """The probe in one of its ``ROLES`` compiled for sm_90 on an official shape (B=4, S=2048, H=16, G=1), no GPU
    needed."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    shape = parse_case(case)
    N, P, R, C = shape["N"], shape["P"], shape["R"], shape["chunk_size"]
    block_p = block_p or min(P, 64)
    num_buffers = num_buffers or ring_depth(C=C, R=R, N=N, block_p=block_p, store_states=ROLES[role][0])
    B, S, H, G = 4, 2048, 16, 1
    # Descriptors only need real strides and dtypes here: tiny CPU tensors viewed with the official shapes.
    base = {dtype: torch.empty(16, dtype=dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    check_shape(B=B, S=S, R=R, G=G, N=N, H=H, P=P, RD=N // 4, chunk_size=C, block_p=block_p,
                dtypes=(torch.bfloat16, torch.float16, torch.bfloat16))
    fake = dict(k=_Shaped(base[torch.bfloat16], (B, S, R, G, N)), v=_Shaped(base[torch.bfloat16], (B, S, H, P)),
                cos_angles=_Shaped(base[torch.float16], (B, S, H, N // 4)),
                sin_angles=_Shaped(base[torch.float16], (B, S, H, N // 4)),
                da_cs=base[torch.float32], da_cs_rev=base[torch.float32], trap_scale=base[torch.float32],
                states=_Shaped(base[torch.bfloat16], (B, H, S // C, N, P)))
    found = descriptors(**fake, chunk_size=C, block_p=block_p)
    signature = {name: mangle_type(desc) for name, desc in found.items()}
    signature.update({name: "*fp32" for name in ("k_bias_ptr", "psi_ptr", "seg_state_ptr", "da_cs_ptr")})
    signature.update({name: "i32" for name in ("S", "H", "G", "NCH", "CHUNKS_PER_SEG", "N_SEGMENTS")})
    store_states, fold_earlier, store_end = ROLES[role]
    constants = dict(C=C, R=R, N=N, P=P, RD=N // 4, BLOCK_P=block_p, NUM_BUFFERS=num_buffers,
                     STORE_STATES=store_states, FOLD_EARLIER=fold_earlier, STORE_END=store_end,
                     BLOCK_SEG_CHUNKS=triton.next_power_of_2(chunks_per_segment), num_warps=4)
    signature.update({name: "constexpr" for name in constants})
    source = GluonASTSource(_gluon_scan_kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=128))


class _Shaped:
    """A stand-in with a tensor's dtype, data pointer, shape and contiguous strides (descriptor metadata only)."""

    def __init__(self, tensor, shape):
        self.dtype, self.shape, self._tensor = tensor.dtype, torch.Size(shape), tensor
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        self._strides = tuple(reversed(strides))

    def data_ptr(self):
        return self._tensor.data_ptr()

    def stride(self):
        return self._strides


def summary(kernel):
    """Resources, the register split the PTX asks for, and the consumer's chunk loop in SASS (the innermost loop
    around the wgmma): its length and its shared-memory traffic, barriers and TMA operations."""
    import aot_report
    import sass_report

    ops = sass_report.sass_ops(kernel)
    loops = []
    for address, opcode, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            body = [op for a, op, _ in ops if int(target.group(1), 16) <= a <= address]
            if any(op.startswith("HGMMA") for op in body):
                loops.append(body)
    loop = min(loops, key=len) if loops else []
    opcodes = collections.Counter(op.split(".")[0] for op in loop)
    ptx = kernel.asm["ptx"]
    return dict(**aot_report.resources(kernel),
                setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                loop=len(loop), **{op: opcodes[op] for op in ("LDS", "STS", "STSM", "BAR", "HGMMA", "LDG")})


def read_box(desc, coords):
    """What a TMA load of ``desc`` at ``coords`` puts in shared memory (elements past the tensor's shape read as
    zeros), read on the host from the descriptor's own base, shape and strides."""
    view = torch.as_strided(desc.base, desc.shape, desc.strides)
    box = torch.zeros(desc.block_shape, dtype=desc.base.dtype)
    inside = tuple(slice(0, max(0, min(size, dim - start))) for size, dim, start in
                   zip(desc.block_shape, desc.shape, coords))
    box[inside] = view[tuple(slice(start, start + piece.stop) for start, piece in zip(coords, inside))]
    return box


def emulate(*, role, k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, trap_scale, states, seg_state,
            chunk_size, n_segments, chunks_per_segment, block_p, **_unused):
    """The kernel's programs in one of its ``ROLES``, step by step in torch on the host (fp32 products): the boxes its
    producer asks for (``descriptors`` and the same coordinates), the consumer's fold, rotation, weights and update,
    its stores into ``states`` (bf16; None in the "end" role) and ``seg_state`` (fp32, read by "store").  It checks
    the descriptors and the index arithmetic on the CPU, where Gluon cannot run; the Gluon code itself is checked on
    the GPU."""
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    RD = cos_angles.shape[3]
    C, HALF, BH, nch = chunk_size, N // 2, BLOCK_HALF, cdiv(S, chunk_size)
    store_states, fold_earlier, store_end = ROLES[role]
    if states is None:
        states = torch.empty((1, 1, 1, BH, block_p), dtype=torch.bfloat16)
    check_shape(B=B, S=S, R=R, G=G, N=N, H=H, P=P, RD=RD, chunk_size=C, block_p=block_p,
                dtypes=(k.dtype, cos_angles.dtype, states.dtype))
    found = descriptors(k=k, v=v, cos_angles=cos_angles, sin_angles=sin_angles, da_cs=da_cs, da_cs_rev=da_cs_rev,
                        trap_scale=trap_scale, states=states, chunk_size=C, block_p=block_p)
    states_rows = torch.as_strided(states, found["states_desc"].shape, found["states_desc"].strides)
    segments = n_segments - 1 if role == "end" else n_segments
    for n0, p0, seg, bh in itertools.product(range(0, HALF, BH), range(0, P, block_p), range(segments),
                                             range(B * H)):
        b, h = divmod(bh, H)
        g = h // (H // G)
        c_first = seg * chunks_per_segment
        pieces = (slice(n0, n0 + BH), slice(HALF + n0, HALF + n0 + BH))  # this program's rows of each half
        p_tile = slice(p0, p0 + block_p)
        rotated = n0 + torch.arange(BH) < RD
        state = torch.zeros(2, BH, block_p)
        for earlier in range(seg if fold_earlier else 0):
            chunk_ends = (earlier * chunks_per_segment + torch.arange(chunks_per_segment)) * C + C - 1
            segment_decay = da_cs.reshape(-1)[bh * S + chunk_ends].sum().exp()
            state = segment_decay * state + torch.stack([seg_state[b, h, earlier, rows, p_tile] for rows in pieces])
        for i in range(min(chunks_per_segment, nch - c_first)):
            row, token = b * S + (c_first + i) * C, bh * S + (c_first + i) * C
            for half in range(2 if store_states else 0):
                first = (bh * nch + c_first + i) * N + half * HALF + n0
                states_rows[first:first + BH, p_tile] = state[half].to(states.dtype)
            k_lo = read_box(found["k_desc"], [0, row, g * N + n0]).float() + k_bias[h, :, None, pieces[0]]
            k_hi = read_box(found["k_desc"], [0, row, g * N + HALF + n0]).float() + k_bias[h, :, None, pieces[1]]
            cos = torch.where(rotated, read_box(found["cos_desc"], [row, h * RD + n0]).float(), 1.0)
            sin = torch.where(rotated, read_box(found["sin_desc"], [row, h * RD + n0]).float(), 0.0)
            weight = (read_box(found["da_rev_desc"], [token]).exp() * read_box(found["trap_scale_desc"], [token]))
            decay = read_box(found["da_cs_desc"], [token])[C - 1].exp()
            v_weighted = read_box(found["v_desc"], [row, h * P + p0]).float() * weight[:, None]
            psiv = (v_weighted[None] * mimo_v[h, :, None, p_tile]).reshape(R * C, block_p)
            a_lo = (cos * k_lo - sin * k_hi).reshape(R * C, BH)
            a_hi = (sin * k_lo + cos * k_hi).reshape(R * C, BH)
            state = decay * state + torch.stack([a_lo.T @ psiv, a_hi.T @ psiv])
        if store_end and seg < n_segments - 1:
            for half, rows in enumerate(pieces):
                seg_state[b, h, seg, rows, p_tile] = state[half]


def production_summary(case):
    """The production scan that stores ``states`` on an official shape as the dispatcher runs it, compiled for sm_90
    (``tma_scan_probe.loop_summary``: resources and its chunk loop), for comparison."""
    import aot_report
    from tma_scan_probe import loop_summary

    aot_report.compile_as_cuda()  # the launches are captured from CPU tensors, as aot_report does
    for name, args, kwargs in aot_report.official_launches(case):
        if name == "state_scan" and kwargs["STORE_STATES"]:
            return dict(num_warps=kwargs.get("num_warps"), local=bool(kwargs["STORE_END"]),
                        **loop_summary(aot_report.compile_launch(name, args, kwargs)))
    return {}


def check_case(case, *, seed=0, num_buffers=None):
    """GPU, an official shape (bf16, the dispatcher's segments and P tile): {role: max relative error of the kernel's
    outputs against the production scan's in that role}."""
    from mamba3_mimo.ops.chunk_state import chunk_states, segment_end_states

    inputs, scan = _official_scan(case, seed=seed)
    n_segments = scan.pop("n_segments")
    B, S, _, _, N = inputs["k"].shape
    H, P = inputs["v"].shape[2:]
    shape, segment_shape = (B, H, S // inputs["chunk_size"], N, P), (B, H, n_segments, N, P)

    def poisoned(size, dtype=torch.bfloat16):
        return torch.full(size, float("nan"), device="cuda", dtype=dtype)

    common = dict(scan, n_segments=n_segments, num_buffers=num_buffers)
    got, got_end = poisoned(shape), poisoned(segment_shape, torch.float32)
    gluon_chunk_local_states(**common, states=got, seg_state=got_end)
    expected = poisoned(shape)
    expected_end = chunk_local_states(**scan, n_segments=n_segments, states=expected, span_chunks=1)
    errors = dict(local=max_relative_error((got, got_end), (expected, expected_end), n_segments))
    if n_segments > 1:
        written = slice(0, n_segments - 1)
        got_end = gluon_segment_end_states(**common, seg_state=poisoned(segment_shape, torch.float32))
        expected_end = segment_end_states(**scan, n_segments=n_segments, span_chunks=1)
        errors["end"] = max_relative_error((got_end[:, :, written], got_end), (expected_end[:, :, written],
                                                                               expected_end), n_segments)
        got, expected = poisoned(shape), poisoned(shape)
        gluon_chunk_states(**common, seg_state=expected_end, states=got)
        chunk_states(**scan, n_segments=n_segments, seg_state=expected_end, states=expected, span_chunks=1)
        errors["store"] = max_relative_error((got, expected_end), (expected, expected_end), n_segments)
    return errors


def _compare_roles(inputs, *, run, device, dot_dtype, num_warps):
    """{"local", "end", "store": max relative error of ``run``'s outputs in that role against the production scan's;
    "golden_local", "golden_store": the normwise error of its final states against the float64 reference}, on
    ``inputs`` with three segments (the last one shorter) and with one.  ``run(role, scan, states, seg_state)``
    writes ``states`` and ``seg_state`` as the kernel would."""
    from mamba3_mimo.accuracy import normwise_error
    from mamba3_mimo.ops.chunk_state import chunk_states, segment_end_states
    from mamba3_mimo.reference import bwd_fwd_reference

    B, S, _, _, N = inputs["k"].shape
    H, P = inputs["v"].shape[2:]
    shape = (B, H, S // inputs["chunk_size"], N, P)
    golden = bwd_fwd_reference(**{name: value.cpu() if torch.is_tensor(value) else value
                                  for name, value in inputs.items()})[0]

    def poisoned(*size, dtype=torch.bfloat16):
        return torch.full(size, float("nan"), device=device, dtype=dtype)

    errors = {}
    for n_segments in (3, 1):
        scan = scan_arguments(inputs, n_segments=n_segments, block_half=N // 2, block_p=64, num_warps=num_warps,
                              dot_dtype=dot_dtype, dot_precision="ieee")
        n_segments = scan.pop("n_segments")
        segment_shape = (B, H, n_segments, N, P)
        got, got_end = poisoned(*shape), poisoned(*segment_shape, dtype=torch.float32)
        run("local", scan, n_segments, got, got_end)
        if n_segments == 1:
            errors["golden_local"] = normwise_error(got.cpu(), golden)
            continue
        expected = poisoned(*shape)
        expected_end = chunk_local_states(**scan, n_segments=n_segments, states=expected, span_chunks=1)
        errors["local"] = max_relative_error((got, got_end), (expected, expected_end), n_segments)
        # Two passes: the end states, then the stored states folded from them.
        got_end = poisoned(*segment_shape, dtype=torch.float32)
        run("end", scan, n_segments, None, got_end)
        expected_end = segment_end_states(**scan, n_segments=n_segments, span_chunks=1)
        written = slice(0, n_segments - 1)  # the last segment's end state is never written
        errors["end"] = max_relative_error((got_end[:, :, written], got_end), (expected_end[:, :, written],
                                                                               expected_end), n_segments)
        # The storing pass from the production's end states, so that it is checked on its own.
        got, expected = poisoned(*shape), poisoned(*shape)
        run("store", scan, n_segments, got, expected_end)
        chunk_states(**scan, n_segments=n_segments, seg_state=expected_end, states=expected, span_chunks=1)
        errors["store"] = max_relative_error((got, expected_end), (expected, expected_end), n_segments)
        errors["golden_store"] = normwise_error(got.cpu(), golden)
    return errors


def small_problem(N, device="cpu"):
    """A small bf16 problem for the role checks: at N = 128 two head groups and two P tiles, at N = 256 two N/2
    tiles, both rotated (RD = N/2); dA_scale 0.1 makes a segment decay by ~e^-1, so that the fold of earlier
    segments weighs in."""
    shape = (dict(B=1, S=256, H=4, G=2, N=128, P=128, R=4, chunk_size=16) if N == 128 else
             dict(B=1, S=128, H=2, G=1, N=256, P=64, R=4, chunk_size=8, rotary_dim_divisor=2))
    if device != "cpu":
        shape["B"] = 2
    return make_inputs(**shape, dtype=torch.bfloat16, seed=5, dA_scale=0.1, device=device)


def check_emulation(N=128):
    """CPU (the interpreter for the production scan): ``emulate`` in each role on ``small_problem(N)``, as
    ``check_small`` runs the kernel on the GPU."""
    inputs = small_problem(N)

    def run(role, scan, n_segments, states, seg_state):
        emulate(role=role, **scan, n_segments=n_segments, states=states, seg_state=seg_state)

    # fp32 products in the production scan: the interpreter miscomputes bf16 tl.dot (SPEC section 10).
    return _compare_roles(inputs, run=run, device="cpu", dot_dtype=tl.float32, num_warps=4)


def check_small(*, N=128, num_buffers=None):
    """GPU: the kernel in each role on ``small_problem(N)`` with three segments (the last one shorter) and with one
    (``_compare_roles``)."""
    inputs = small_problem(N, device="cuda")
    wrappers = dict(local=gluon_chunk_local_states, end=gluon_segment_end_states, store=gluon_chunk_states)

    def run(role, scan, n_segments, states, seg_state):
        if role != "end":
            scan = dict(scan, states=states)
        wrappers[role](**scan, n_segments=n_segments, seg_state=seg_state, num_buffers=num_buffers)

    return _compare_roles(inputs, run=run, device="cuda", dot_dtype=tl.bfloat16, num_warps=8)


def _official_scan(case, *, seed, n_segments=None):
    shape = parse_case(case)
    config = choose_config(B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                           has_z=True, **shape)
    inputs = make_inputs(B=4, S=2048, H=16, G=1, dtype=torch.bfloat16, device="cuda", seed=seed, **shape)
    scan = scan_arguments(inputs, n_segments=n_segments or config.n_segments, block_half=config.block_half,
                          block_p=config.block_p, num_warps=config.num_warps, dot_dtype=tl.bfloat16,
                          dot_precision="ieee")
    return inputs, scan


def time_case(case, reps):
    """ms of the production scans as the dispatcher configures them (tiles, segments, spans) and of the Gluon
    kernel in the same roles, at the dispatcher's segment count and at twice it: the local-state pass, and the two
    passes (end states, then the stored states), with the Gluon kernel's errors (``check_case``)."""
    from mamba3_mimo.ops.chunk_state import chunk_states, segment_end_states

    shape = parse_case(case)
    config = choose_config(B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                           has_z=True, **shape)
    record = dict(case=case, dispatcher_local=config.local_states, errors=check_case(case))
    for segments in (config.n_segments, 2 * config.n_segments):
        inputs, scan = _official_scan(case, seed=0, n_segments=segments)
        n_segments = scan.pop("n_segments")
        states = torch.empty((4, 16, 2048 // inputs["chunk_size"], shape["N"], shape["P"]), device="cuda",
                             dtype=torch.bfloat16)
        end = segment_end_states(**scan, n_segments=n_segments, span_chunks=config.end_span_chunks)

        def bench(fn):
            return triton.testing.do_bench(fn, rep=reps)

        timed = dict(
            production_local=lambda: chunk_local_states(**scan, n_segments=n_segments, states=states,
                                                        span_chunks=config.state_span_chunks),
            gluon_local=lambda: gluon_chunk_local_states(**scan, n_segments=n_segments, states=states),
            production_end=lambda: segment_end_states(**scan, n_segments=n_segments,
                                                      span_chunks=config.end_span_chunks),
            gluon_end=lambda: gluon_segment_end_states(**scan, n_segments=n_segments),
            production_store=lambda: chunk_states(**scan, n_segments=n_segments, seg_state=end, states=states,
                                                  span_chunks=config.state_span_chunks),
            gluon_store=lambda: gluon_chunk_states(**scan, n_segments=n_segments, seg_state=end, states=states),
        )
        for name, fn in timed.items():
            try:
                record[f"{name}_seg{n_segments}_ms"] = bench(fn)
            except Exception as error:  # a variant that fails to launch is a finding, not a crash
                record[f"{name}_seg{n_segments}_failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return record


GLUON_CASES = ["N256_P64_R4_C8", "N128_P64_R4_C16", "N128_P32_R4_C16", "N128_P128_R4_C8", "N128_P64_R8_C8",
               "N128_P64_R2_C32", "N128_P64_R1_C64"]


def compile_records(case, roles, with_production=False):
    """--compile-only's records for one case: each role compiled at the P tile and ring depth the wrappers choose."""
    shape = parse_case(case)
    C, R, N, block_p = shape["chunk_size"], shape["R"], shape["N"], min(shape["P"], 64)
    records = [dict(case=case, kernel="production storing scan", **production_summary(case))] if with_production else []
    for role in roles:
        store_states = ROLES[role][0]
        depth = ring_depth(C=C, R=R, N=N, block_p=block_p, store_states=store_states)
        model = shared_bytes(C=C, R=R, N=N, block_p=block_p, num_buffers=depth, store_states=store_states)
        records.append(dict(case=case, role=role, block_p=block_p, num_buffers=depth, shared_model=model,
                            **summary(compile_for_sm90(case, role=role, block_p=block_p, num_buffers=depth))))
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=GLUON_CASES)
    parser.add_argument("--roles", nargs="+", default=list(ROLES), choices=list(ROLES),
                        help="with --compile-only: the kernel's roles to compile")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--with-production", action="store_true",
                        help="with --compile-only: also the production scan that stores states, for comparison")
    parser.add_argument("--reps", type=int, default=200, help="do_bench's rep (ms)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    records = []
    if not args.compile_only:
        for N in (128, 256):
            records.append(dict(case=f"small N={N}", **check_small(N=N)))
            print(records[-1], flush=True)
    for case in args.cases:
        found = (compile_records(case, args.roles, args.with_production) if args.compile_only
                 else [time_case(case, args.reps)])
        for record in found:
            print(record, flush=True)
        records += found
    if args.json:
        with open(args.json, "w") as out:
            json.dump(records, out, indent=1)


if __name__ == "__main__":
    main()
