"""gate_grads as a Gluon kernel for Hopper: the same streaming pass, its tiles brought in by TMA through a ring.

``gate_grads.py`` (Triton) keeps one tile of look-ahead in registers; the running sums and the rank-redundant dout /
z / v copies take the registers a deeper look-ahead would need, and it moves its bytes at 2.0-2.2 TB/s, half the
copy bandwidth (docs/optimization.md sections 23-26).  Here every tile of a program's token range is asked for
``NUM_BUFFERS - 1`` tiles ahead by TMA into a ring of shared-memory stages (no registers held for it), and each
tile is read out of shared memory in one register layout chosen once.  On an H100 that made the pass 7-19% faster
(section 37), not the ~40% its bytes allowed: both forms are held by their instruction issue (this one at ~62% of its
issue rate with 35 SASS an element at R = 4, the Triton one at ~48% with 30), not by bytes in flight.

- raw_y [B, H, S, R, P] (fp16 scaled per row, as ``chunk_scan`` stores it) as [1, tokens, R, P tile] boxes of its
  [B * H, S, R, P] view; dout, z and v as [1, tokens, P tile] boxes of their [B, S, H * P] views.  Boxes past S
  are zero-filled, and a zero token adds nothing to any sum (its dz is masked);
- a thread holds 8 columns of one (token, rank) row; a warp's lanes span the ranks and the columns, so dz's rank
  sum stays in the warp, and dout / z / v are read by every rank lane from the same shared addresses (broadcast).

What it covers (``unsupported``): a Hopper GPU outside the interpreter, the fp16 raw_y scratch, 16-bit dout / z / v
(the approximate sigmoid of ``host_utils.sigmoid_units``), R a power of two up to 8, P a multiple of the P tile,
contiguous 16-byte aligned tensors.  Elsewhere the production path takes ``gate_grads``.  Gluon does not run in the
Triton interpreter: its values are checked against ``gate_grads`` on the GPU (``tests/test_gluon_gate_grads.py``).
"""

import torch
from triton import knobs
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .gate_grads import gate_grads_meta
from .host_utils import cdiv
from .launch import launch
from .triton_utils import fast_sigmoid, wait_for_previous_grid

SMEM_LIMIT = 101_376  # the project's per-launch shared-memory bound (99 KB)
COLS_PER_THREAD = 8  # one 16-byte fp16 / bf16 vector of a row
MAX_RANKS = 8
NUM_WARPS = 4
# Ring stages, token rows a thread holds, ranks a thread holds, per R: the best of the variants timed on an H100
# (benchmarks/results/2026-12-05_h100_gluon_gate_78c9439.json; docs/optimization.md section 37).  At R = 4 the ranks
# across lanes and a 4-stage ring of 8-token tiles (128 registers, 4 programs an SM); at R = 8 two ranks a thread
# (dz's rank sum half in registers, half across lanes) and 6 stages of 16-token tiles.
TILE_VARIANTS = {4: dict(num_buffers=4, tokens_per_thread=2, ranks_per_thread=1),
                 8: dict(num_buffers=6, tokens_per_thread=2, ranks_per_thread=2)}


def tile_variant(R):
    """Ring stages, token rows a thread and ranks a thread for R ranks (R = 4's where R = 8's was not timed)."""
    return dict(TILE_VARIANTS[8 if R >= 8 else 4])


@gluon.constexpr_function
def _tile_layout(R, block_p, ranks_per_thread, num_warps):
    """[tokens, ranks, cols] tiles: 8 columns of ``ranks_per_thread`` ranks a thread, a warp's lanes over the rest of
    the ranks and the column groups (the rest over tokens), the warps over tokens."""
    col_lanes = block_p // 8
    rank_lanes = R // ranks_per_thread
    return gl.BlockedLayout([1, ranks_per_thread, 8], [32 // (rank_lanes * col_lanes), rank_lanes, col_lanes],
                            [num_warps, 1, 1], [2, 1, 0])


@gluon.jit
def _issue_tile(tile, n_tiles, y_desc, dout_desc, z_desc, v_desc, y_bufs, dout_bufs, z_bufs, v_bufs, ready,
                bh, b, h, first, p0, P: gl.constexpr, BLOCK_T: gl.constexpr, HAS_Z: gl.constexpr,
                HAS_D: gl.constexpr, INPUTS: gl.constexpr = True, RAW_Y: gl.constexpr = True):
    """Ask for tile ``tile``'s boxes (nothing past the program's last tile) on its stage's barrier: the raw_y box and
    the inputs' (dout, z, v) boxes, or only one of the two (``INPUTS`` / ``RAW_Y``; the barrier is told the whole
    tile's bytes with the inputs, so it completes only once raw_y's box has landed too)."""
    NUM_BUFFERS: gl.constexpr = y_bufs.type.shape[0]
    TILE_BYTES: gl.constexpr = y_desc.block_type.nbytes + dout_desc.block_type.nbytes * (1 + HAS_Z + HAS_D)
    stage = tile % NUM_BUFFERS
    bar = ready.index(stage)
    wanted = tile < n_tiles
    t = first + tile * BLOCK_T
    if INPUTS:
        mbarrier.expect(bar, TILE_BYTES, pred=wanted)
    if RAW_Y:
        tma.async_copy_global_to_shared(y_desc, [bh, t, 0, p0], bar, y_bufs.index(stage), pred=wanted)
    if INPUTS:
        tma.async_copy_global_to_shared(dout_desc, [b, t, h * P + p0], bar, dout_bufs.index(stage), pred=wanted)
        if HAS_Z:
            tma.async_copy_global_to_shared(z_desc, [b, t, h * P + p0], bar, z_bufs.index(stage), pred=wanted)
        if HAS_D:
            tma.async_copy_global_to_shared(v_desc, [b, t, h * P + p0], bar, v_bufs.index(stage), pred=wanted)


@gluon.jit
def _gluon_gate_grads_kernel(
    y_desc, dout_desc, z_desc, v_desc, raw_y_scale_ptr, phi_ptr, zeta_ptr, psi_ptr, d_ptr, dz_ptr, dphi_ptr,
    dzeta_ptr, S, H, N_RANGES, N_PBLOCKS, TOKENS_PER_PROGRAM, N_SCALE_TILES, SCALE_COLS,
    R: gl.constexpr, P: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_P: gl.constexpr, NUM_BUFFERS: gl.constexpr,
    RANKS_PER_THREAD: gl.constexpr, HAS_Z: gl.constexpr, HAS_D: gl.constexpr, num_warps: gl.constexpr,
    GDC: gl.constexpr = False,
):
    """One program: one (b, h), a range of tokens and a P tile, as ``gate_grads``' kernel (the same partials)."""
    pid = gl.program_id(0)
    token_range = pid // N_PBLOCKS
    p0 = (pid % N_PBLOCKS) * BLOCK_P
    bh = gl.program_id(1)  # int32 for the TMA coordinates; offsets into global memory in int64
    b = bh // H
    h = bh % H
    bh64 = bh.to(gl.int64)
    first = token_range * TOKENS_PER_PROGRAM
    last = gl.minimum(first + TOKENS_PER_PROGRAM, S)
    n_tiles = gl.cdiv(last - first, BLOCK_T)

    layout: gl.constexpr = _tile_layout(R, BLOCK_P, RANKS_PER_THREAD, num_warps)
    rc_layout: gl.constexpr = gl.SliceLayout(0, layout)  # [ranks, cols]
    tc_layout: gl.constexpr = gl.SliceLayout(1, layout)  # [tokens, cols]
    tr_layout: gl.constexpr = gl.SliceLayout(2, layout)  # [tokens, ranks]

    y_bufs = gl.allocate_shared_memory(y_desc.dtype, [NUM_BUFFERS] + y_desc.block_type.shape, y_desc.layout)
    dout_bufs = gl.allocate_shared_memory(dout_desc.dtype, [NUM_BUFFERS] + dout_desc.block_type.shape,
                                          dout_desc.layout)
    if HAS_Z:
        z_bufs = gl.allocate_shared_memory(z_desc.dtype, [NUM_BUFFERS] + z_desc.block_type.shape, z_desc.layout)
    else:
        z_bufs = dout_bufs
    if HAS_D:
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_BUFFERS] + v_desc.block_type.shape, v_desc.layout)
    else:
        v_bufs = dout_bufs
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
    # Under programmatic dependent launch the first tiles' dout / z / v (inputs of the call) are asked for before the
    # wait for chunk_scan, which writes raw_y and its scales; raw_y's boxes after it.
    for tile in gl.static_range(NUM_BUFFERS - 1):
        _issue_tile(tile, n_tiles, y_desc, dout_desc, z_desc, v_desc, y_bufs, dout_bufs, z_bufs, v_bufs, ready,
                    bh, b, h, first, p0, P, BLOCK_T, HAS_Z, HAS_D, RAW_Y=not GDC)
    if GDC:
        wait_for_previous_grid(GDC)
        for tile in gl.static_range(NUM_BUFFERS - 1):
            _issue_tile(tile, n_tiles, y_desc, dout_desc, z_desc, v_desc, y_bufs, dout_bufs, z_bufs, v_bufs, ready,
                        bh, b, h, first, p0, P, BLOCK_T, HAS_Z, HAS_D, INPUTS=False)

    # Per (rank, col) constants: Phi Zeta for dz, Zeta for the gate's input, D Psi for the skip.
    rc_ranks = gl.arange(0, R, gl.SliceLayout(1, rc_layout))[:, None]
    rc_cols = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, rc_layout))[None, :]
    head_rc = (h * R + rc_ranks) * P + rc_cols
    phi = gl.load(phi_ptr + head_rc)
    if HAS_Z:
        zeta = gl.load(zeta_ptr + head_rc)
        dz_weight = phi * zeta
    if HAS_D:
        d_psi = gl.load(d_ptr + h) * gl.load(psi_ptr + head_rc)

    tc_tokens = gl.arange(0, BLOCK_T, gl.SliceLayout(1, tc_layout))[:, None]
    tc_cols = p0 + gl.arange(0, BLOCK_P, gl.SliceLayout(0, tc_layout))[None, :]
    dz_offs = (b.to(gl.int64) * S * H + h) * P + tc_tokens * (H * P) + tc_cols
    tr_tokens = gl.arange(0, BLOCK_T, gl.SliceLayout(1, tr_layout))[:, None]
    tr_ranks = gl.arange(0, R, gl.SliceLayout(0, tr_layout))[None, :]
    # The block's columns lie in one scale tile (BLOCK_P divides SCALE_COLS, as in gate_grads).
    scale_offs = (bh64 * S + tr_tokens) * (R * N_SCALE_TILES) + tr_ranks * N_SCALE_TILES + p0 // SCALE_COLS

    dphi_acc = gl.zeros([BLOCK_T, R, BLOCK_P], gl.float32, layout)
    dzeta_acc = gl.zeros([BLOCK_T, R, BLOCK_P], gl.float32, layout)
    # The row scales are a few floats a tile: loaded one tile ahead from global memory.
    next_unscale = gl.load(raw_y_scale_ptr + scale_offs + first * (R * N_SCALE_TILES),
                           mask=first + tr_tokens < last, other=0.0)
    for i in range(n_tiles):
        # Every thread is done with the stage consumed last iteration before TMA writes it again.
        gl.thread_barrier()
        fence_async_shared()
        _issue_tile(i + NUM_BUFFERS - 1, n_tiles, y_desc, dout_desc, z_desc, v_desc, y_bufs, dout_bufs, z_bufs,
                    v_bufs, ready, bh, b, h, first, p0, P, BLOCK_T, HAS_Z, HAS_D)
        t0 = first + i * BLOCK_T
        unscale = next_unscale
        next_unscale = gl.load(raw_y_scale_ptr + scale_offs + (t0 + BLOCK_T) * (R * N_SCALE_TILES),
                               mask=t0 + BLOCK_T + tr_tokens < last, other=0.0)
        stage = i % NUM_BUFFERS
        mbarrier.wait(ready.index(stage), (i // NUM_BUFFERS) & 1)
        y = y_bufs.index(stage).reshape([BLOCK_T, R, BLOCK_P]).load(layout).to(gl.float32) * unscale[:, :, None]
        dout = dout_bufs.index(stage).reshape([BLOCK_T, BLOCK_P]).load(tc_layout).to(gl.float32)
        if HAS_D:
            v = v_bufs.index(stage).reshape([BLOCK_T, BLOCK_P]).load(tc_layout).to(gl.float32)
            y += d_psi[None, :, :] * v[:, None, :]
        y_dout = y * dout[:, None, :]
        if HAS_Z:
            z = z_bufs.index(stage).reshape([BLOCK_T, BLOCK_P]).load(tc_layout).to(gl.float32)[:, None, :]
            u = z * zeta[None, :, :]
            sig = fast_sigmoid(u)
            du_over_phi = y_dout * (sig * (1.0 + u * (1.0 - sig)))  # dL/du without its Phi factor
            dphi_acc += (u * sig) * y_dout
            dzeta_acc += du_over_phi * z
            dz = gl.sum(du_over_phi * dz_weight[None, :, :], axis=1)
            gl.store(dz_ptr + dz_offs + t0 * (H * P), dz.to(dz_ptr.dtype.element_ty), mask=t0 + tc_tokens < last)
        else:
            dphi_acc += y_dout

    part = (bh64 * N_RANGES + token_range) * R * P + rc_ranks * P + rc_cols
    gl.store(dphi_ptr + part, gl.sum(dphi_acc, axis=0))
    if HAS_Z:
        gl.store(dzeta_ptr + part, phi * gl.sum(dzeta_acc, axis=0))


def tile_columns(*, R, P, scale_block_p):
    """Columns of a tile: ``gate_grads``' P tile (within one row-scale tile, ranks x column lanes within a warp)."""
    return gate_grads_meta(R=R, P=P, max_block_p=scale_block_p)["BLOCK_P"]


def block_tokens(*, R, block_p, tokens_per_thread, ranks_per_thread, num_warps=NUM_WARPS):
    """Tokens of one tile: the layout's token lanes times the warps, ``tokens_per_thread`` rows a thread."""
    return max(1, 32 // (R // ranks_per_thread * (block_p // COLS_PER_THREAD))) * num_warps * tokens_per_thread


def shared_bytes(*, R, block_p, block_t, num_buffers, has_z=True, has_d=True):
    """The ring's bytes (the compiler adds its barriers and alignment)."""
    return num_buffers * block_t * block_p * 2 * (R + 1 + has_z + has_d)


def unsupported(*, raw_y, raw_y_scale, dout, z, dz, block_p, v=None, **_unused):
    """None where the kernel can take these ``gate_grads`` arguments, else the reason."""
    if not raw_y.is_cuda or knobs.runtime.interpret or torch.cuda.get_device_capability(raw_y.device)[0] != 9:
        return "needs a Hopper GPU (TMA) outside the Triton interpreter"
    if raw_y.dtype != torch.float16 or raw_y_scale is None:
        return "needs the fp16 raw_y scratch with its row scales"
    B, H, S, R, P = raw_y.shape
    if R & (R - 1) or R > MAX_RANKS:
        return f"needs R a power of two up to {MAX_RANKS}, got R={R}"
    if P % block_p or block_p % COLS_PER_THREAD or R * block_p // COLS_PER_THREAD > 32:
        return f"needs P a multiple of a P tile of 8-column groups within a warp, got P={P}, block_p={block_p}"
    tensors = dict(raw_y=raw_y, raw_y_scale=raw_y_scale, dout=dout, z=z, v=v, dz=dz)
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not tensor.is_contiguous() or tensor.data_ptr() % 16:
            return f"needs {name} contiguous and 16-byte aligned"
        if name in ("dout", "z", "v") and tensor.dtype not in (torch.float16, torch.bfloat16):
            return f"needs 16-bit {name} (the approximate sigmoid), got {tensor.dtype}"
    if (H * P * 2) % 16:
        return f"needs 16-byte rows of dout / z / v, got H * P = {H * P}"
    return None


def _box(tensor, shape, strides, block):
    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[tensor.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(block, element)
    return TensorDescriptor(tensor, list(shape), list(strides), list(block), layout)


def gluon_gate_grads(*, raw_y, raw_y_scale, scale_block_p, dout, z, mimo_o, mimo_z, dz, v=None, mimo_v=None, d=None,
                     tokens_per_program=256, num_buffers=None, tokens_per_thread=None, ranks_per_thread=None,
                     **_unused):
    """``gate_grads`` (same arguments and partials) through the Gluon kernel; ``unsupported`` says where it runs.
    ``num_buffers``: stages of the ring; ``tokens_per_thread``: token rows of a tile a thread holds;
    ``ranks_per_thread``: ranks of a (token, column) a thread holds (the rest across lanes); None: ``tile_variant``."""
    B, H, S, R, P = raw_y.shape
    has_z, has_d = z is not None, d is not None
    block_p = tile_columns(R=R, P=P, scale_block_p=scale_block_p)
    reason = unsupported(raw_y=raw_y, raw_y_scale=raw_y_scale, dout=dout, z=z, v=v, dz=dz, block_p=block_p)
    if reason:
        raise ValueError(f"gluon_gate_grads: {reason}")
    chosen = tile_variant(R)
    num_buffers = num_buffers or chosen["num_buffers"]
    tokens_per_thread = tokens_per_thread or chosen["tokens_per_thread"]
    ranks_per_thread = min(ranks_per_thread or chosen["ranks_per_thread"], R)
    block_t = block_tokens(R=R, block_p=block_p, tokens_per_thread=tokens_per_thread, ranks_per_thread=ranks_per_thread)
    tokens_per_program = cdiv(tokens_per_program, block_t) * block_t
    n_ranges = cdiv(S, tokens_per_program)
    n_pblocks = P // block_p
    dphi = torch.empty((B, H, n_ranges, R, P), device=raw_y.device, dtype=torch.float32)
    dzeta = torch.empty_like(dphi) if has_z else None
    activations = [B, S, H * P], [S * H * P, H * P, 1], [1, block_t, block_p]
    dout_desc = _box(dout, *activations)
    launch(_gluon_gate_grads_kernel, (n_ranges * n_pblocks, B * H),
           _box(raw_y, [B * H, S, R, P], [S * R * P, R * P, P, 1], [1, block_t, R, block_p]), dout_desc,
           _box(z, *activations) if has_z else dout_desc, _box(v, *activations) if has_d else dout_desc,
           raw_y_scale, mimo_o, mimo_z if has_z else mimo_o, mimo_v if has_d else mimo_o, d if has_d else mimo_o,
           dz if has_z else dout, dphi, dzeta if has_z else dphi,
           S, H, n_ranges, n_pblocks, tokens_per_program, raw_y_scale.shape[-1], scale_block_p,
           R=R, P=P, BLOCK_T=block_t, BLOCK_P=block_p, NUM_BUFFERS=num_buffers, RANKS_PER_THREAD=ranks_per_thread,
           HAS_Z=has_z, HAS_D=has_d,
           num_warps=NUM_WARPS)
    return dphi, dzeta
