"""Stage 4 of the split output path: the gradients of the output projection and of the SiLU gate.

``out[t, p] = sum_r Phi[r, p] silu(z[t, p] Zeta[r, p]) raw_y[t, r, p]`` is linear in ``raw_y``
given z, so once ``chunk_scan`` has stored raw_y the gradients are a streaming pass over tokens:

    dPhi[r, p]  = sum_t gate raw_y dout                 (per token range, summed by ``sum_group_partials``)
    dL/du       = dout Phi raw_y silu'(u),  u = z Zeta
    dz[t, p]    = sum_r dL/du Zeta[r, p],   dZeta[r, p] = sum_t dL/du z[t, p]

One program owns one (b, h), a range of tokens and a block of P columns.  It walks the range in
[ranks, tokens, cols] tiles of raw_y (stored [tokens, ranks, cols]; cols stay contiguous); with ranks
outermost the compiler lays them across the lanes of a warp, so dz's rank sum stays inside a warp.
The token sums of dPhi / dZeta are per-thread running sums, reduced across threads once per program
instead of once per rank and token block.
"""

import torch
import triton
import triton.language as tl

from . import host_utils
from .host_utils import cdiv, next_power_of_2
from .launch import launch
from .triton_utils import silu_and_grad, wait_for_previous_grid

# Elements of one [ranks, tokens, cols] tile: 16 per thread at 4 warps, so each thread's raw_y slice
# is four 16-byte fp32 loads and the two fp32 running sums take 32 registers (128 in all, 4 CTAs per SM).
TILE_ELEMENTS = 2048
MAX_BLOCK_P = 64
# Lanes of a warp: a tile's ranks times its column lanes (8 columns each) fit in one warp, so dz's rank sum
# stays inside the warp.  At R = 8 a 64-column tile split its ranks over two warps: a shared-memory sum and
# 255 registers a thread (2 CTAs per SM); 32 columns keep it to 128.
WARP_LANES = 32
# Register cap with the D skip added here (ScanConfig.d_in_gate): the 4 CTAs an SM of the plain kernel.
D_SKIP_MAX_REGISTERS = 128


@triton.jit
def _load_raw_y(raw_y_ptr, raw_y_scale_ptr, y_offs, scale_offs, t_first, row_mask, mask, N_SCALE_TILES,
                R: tl.constexpr, P: tl.constexpr, SCALED_RAW_Y: tl.constexpr):
    """The [ranks, tokens, cols] raw_y tile of the tokens from t_first on, as stored (masked elements 0), and with
    an fp16 scratch the [ranks, tokens, 1] inverse scales of its rows (else 1): raw_y = tile * scales."""
    raw_y = tl.load(raw_y_ptr + y_offs + t_first * (R * P), mask=mask, other=0.0)
    if SCALED_RAW_Y:
        unscale = tl.load(raw_y_scale_ptr + scale_offs + t_first * (R * N_SCALE_TILES), mask=row_mask, other=0.0)
    else:
        unscale = 1.0
    return raw_y, unscale


@triton.jit
def _gate_grads_kernel(
    raw_y_ptr, raw_y_scale_ptr, dout_ptr, z_ptr, v_ptr, phi_ptr, zeta_ptr, psi_ptr, d_ptr, dz_ptr, dphi_ptr,
    dzeta_ptr, S, H, N_RANGES, N_PBLOCKS, TOKENS_PER_PROGRAM, N_SCALE_TILES, SCALE_COLS,
    R: tl.constexpr, P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_Z: tl.constexpr, FAST_SIGMOID: tl.constexpr, PRECISE_SIGMOID: tl.constexpr, SCALED_RAW_Y: tl.constexpr,
    HAS_D: tl.constexpr,
    GDC: tl.constexpr = False,
):
    pid = tl.program_id(0)
    token_range = pid // N_PBLOCKS
    p_block = pid % N_PBLOCKS
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    ranks = tl.arange(0, BLOCK_R)[:, None, None]
    offs_t = tl.arange(0, BLOCK_T)[None, :, None]
    cols = p_block * BLOCK_P + tl.arange(0, BLOCK_P)[None, None, :]
    rank_col_mask = (ranks < R) & (cols < P)

    # Per (rank, col) constants; padding ranks and columns are 0, so their terms vanish.
    head_rc = (h * R + ranks) * P + cols
    phi = tl.load(phi_ptr + head_rc, mask=rank_col_mask, other=0.0)
    if HAS_Z:
        zeta = tl.load(zeta_ptr + head_rc, mask=rank_col_mask, other=0.0)
        dz_weight = phi * zeta
    if HAS_D:
        # raw_y comes without the D skip (chunk_scan ran without D): D psiv = (D Psi) v is added here, in fp32.
        d_psi = tl.load(d_ptr + h).to(tl.float32) * tl.load(psi_ptr + head_rc, mask=rank_col_mask, other=0.0)

    # Activations [B, S, H, P] at (b, t, h, col), read with a rank stride of 0: the same addresses for
    # every rank of a warp, so the tiles share raw_y's layout and no layout conversion is needed.
    act_offs = (b * S * H + h) * P + cols + offs_t * (H * P) + ranks * 0
    y_offs = bh * S * R * P + offs_t * (R * P) + ranks * P + cols
    # The block's columns lie in one scale tile (BLOCK_P divides SCALE_COLS, gate_grads_meta).
    scale_offs = (bh * S * R + offs_t * R + ranks) * N_SCALE_TILES + (p_block * BLOCK_P) // SCALE_COLS
    cols_2d = p_block * BLOCK_P + tl.arange(0, BLOCK_P)[None, :]
    dz_base = (b * S * H + h) * P
    first = token_range.to(tl.int64) * TOKENS_PER_PROGRAM  # token offsets in int64: S * R * P may pass 2^31
    last = tl.minimum(first + TOKENS_PER_PROGRAM, S)

    dphi_acc = tl.zeros((BLOCK_R, BLOCK_T, BLOCK_P), dtype=tl.float32)
    dzeta_acc = tl.zeros((BLOCK_R, BLOCK_T, BLOCK_P), dtype=tl.float32)
    row_mask = (first + offs_t < last) & (ranks < R)
    mask = row_mask & (cols < P)
    if not GDC:
        raw_y, unscale = _load_raw_y(raw_y_ptr, raw_y_scale_ptr, y_offs, scale_offs, first, row_mask, mask,
                                     N_SCALE_TILES, R, P, SCALED_RAW_Y)
    dout = tl.load(dout_ptr + act_offs + first * (H * P), mask=mask, other=0.0)
    z = tl.load(z_ptr + act_offs + first * (H * P), mask=mask & HAS_Z, other=0.0)
    v = tl.load(v_ptr + act_offs + first * (H * P), mask=mask & HAS_D, other=0.0)
    if GDC:
        # Under programmatic dependent launch the head's constants above and the first tile of dout / z / v (inputs of
        # the call) are asked for before the wait for chunk_scan, which writes raw_y; raw_y after it.
        wait_for_previous_grid(GDC)
        raw_y, unscale = _load_raw_y(raw_y_ptr, raw_y_scale_ptr, y_offs, scale_offs, first, row_mask, mask,
                                     N_SCALE_TILES, R, P, SCALED_RAW_Y)
    for t0 in range(first, last, BLOCK_T):
        # The next block's tiles are in flight while this block's gate math runs.
        t_next = t0 + BLOCK_T
        next_row_mask = (t_next + offs_t < last) & (ranks < R)
        next_mask = next_row_mask & (cols < P)
        raw_y_next, unscale_next = _load_raw_y(raw_y_ptr, raw_y_scale_ptr, y_offs, scale_offs, t_next,
                                               next_row_mask, next_mask, N_SCALE_TILES, R, P, SCALED_RAW_Y)
        dout_next = tl.load(dout_ptr + act_offs + t_next * (H * P), mask=next_mask, other=0.0)
        z_next = tl.load(z_ptr + act_offs + t_next * (H * P), mask=next_mask & HAS_Z, other=0.0)
        v_next = tl.load(v_ptr + act_offs + t_next * (H * P), mask=next_mask & HAS_D, other=0.0)

        # Held as stored (fp16: half the registers of the look-ahead), decoded here.
        y = raw_y.to(tl.float32) * unscale
        if HAS_D:
            y += d_psi * v.to(tl.float32)
        y_dout = y * dout.to(tl.float32)
        if HAS_Z:
            z_f = z.to(tl.float32)
            gate, dgate = silu_and_grad(z_f * zeta, FAST_SIGMOID, PRECISE_SIGMOID)
            du_over_phi = y_dout * dgate  # dL/du without its Phi factor, constant over tokens
            dphi_acc += gate * y_dout
            dzeta_acc += du_over_phi * z_f
            # Stored as a [ranks, tokens, cols] tile that only rank 0 writes: in the tiles' own layout, where
            # a [tokens, cols] store took a layout conversion through shared memory and a barrier every block.
            dz = tl.sum(du_over_phi * dz_weight, axis=0, keep_dims=True)
            dz_tokens = t0 + offs_t
            tl.store(dz_ptr + dz_base + dz_tokens * (H * P) + cols + ranks * 0, dz.to(dz_ptr.dtype.element_ty),
                     mask=(dz_tokens < last) & (cols < P) & (ranks == 0))
        else:
            dphi_acc += y_dout
        raw_y, unscale, dout, z, v = raw_y_next, unscale_next, dout_next, z_next, v_next

    ranks_2d = tl.arange(0, BLOCK_R)[:, None]
    part = (bh * N_RANGES + token_range) * R * P + ranks_2d * P + cols_2d
    part_mask = (ranks_2d < R) & (cols_2d < P)
    tl.store(dphi_ptr + part, tl.sum(dphi_acc, axis=1), mask=part_mask)
    if HAS_Z:
        tl.store(dzeta_ptr + part, tl.sum(phi * dzeta_acc, axis=1), mask=part_mask)


def gate_grads_meta(*, R, P, max_block_p=MAX_BLOCK_P, tile_elements=TILE_ELEMENTS):
    """Tile sizes of ``gate_grads``: BLOCK_R = next_pow2(R) ranks, up to 64 columns (fewer from R = 8 on,
    so that ranks x column lanes fit one warp; at most ``max_block_p``, a power of two), the rest tokens
    (``tile_elements`` in all, a power of two)."""
    block_r = next_power_of_2(R)
    block_p = min(MAX_BLOCK_P, max_block_p, max(1, WARP_LANES // block_r) * 8, next_power_of_2(P))
    block_t = max(1, tile_elements // (block_r * block_p))
    return dict(BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_P=block_p)


def gate_grads(*, raw_y, dout, z, mimo_o, mimo_z, dz, raw_y_scale=None, scale_block_p=None, v=None, mimo_v=None,
               d=None, tokens_per_program=64, tile_elements=TILE_ELEMENTS, num_warps=4):
    """Write ``dz`` and return the per-token-range partials of dPhi and dZeta.

    Args (contiguous): raw_y: [B, H, S, R, P] fp32, or fp16 with raw_y_scale: [B, H, S, R, cdiv(P,
        scale_block_p)] fp32, the inverse row scales ``chunk_scan`` wrote per P tile of ``scale_block_p``
        columns (a power of two); dout, z: [B, S, H, P] (z may be None); mimo_o, mimo_z: [H, R, P] fp32
        (mimo_z None with z); dz: [B, S, H, P] or None.
        v: [B, S, H, P], mimo_v: [H, R, P] fp32, d: [H] fp32, all three or none: raw_y was computed without
        the D skip (``chunk_scan`` with d=None) and D v Psi is added to it here, in fp32.
        tokens_per_program: the token range of one program (rounded up to whole tiles).
        tile_elements: elements of one [ranks, tokens, cols] tile (a power of two; ``gate_grads_meta``).
    Returns:
        dphi_partial, dzeta_partial: [B, H, n_ranges, R, P] fp32 (dzeta_partial None without Z), to be
        summed over dim 2 by ``sum_group_partials``.
    """
    B, H, S, R, P = raw_y.shape
    scaled = host_utils.check_raw_y_scratch("gate_grads", raw_y, raw_y_scale, scale_block_p)
    has_d = d is not None
    if (v is None) == has_d or (mimo_v is None) == has_d:
        raise ValueError("gate_grads: v, mimo_v and d (the D skip added here) go together")
    if tile_elements < 1 or tile_elements & (tile_elements - 1):
        raise ValueError(f"gate_grads: tile_elements must be a power of two, got {tile_elements}")
    n_scale_tiles, scale_cols = 1, P
    if scaled:
        n_scale_tiles, scale_cols = cdiv(P, scale_block_p), scale_block_p
    meta = gate_grads_meta(R=R, P=P, max_block_p=scale_cols if scaled else MAX_BLOCK_P, tile_elements=tile_elements)
    tokens_per_program = cdiv(tokens_per_program, meta["BLOCK_T"]) * meta["BLOCK_T"]
    n_ranges = cdiv(S, tokens_per_program)
    n_pblocks = cdiv(P, meta["BLOCK_P"])
    has_z = z is not None
    dphi = torch.empty((B, H, n_ranges, R, P), device=raw_y.device, dtype=torch.float32)
    dzeta = torch.empty_like(dphi) if has_z else None
    launch(_gate_grads_kernel, (n_ranges * n_pblocks, B * H),
        raw_y, raw_y_scale if scaled else raw_y, dout, z if has_z else dout, v if has_d else dout, mimo_o,
        mimo_z if has_z else mimo_o, mimo_v if has_d else mimo_o, d if has_d else mimo_o, dz if has_z else dout, dphi,
        dzeta if has_z else dphi, S, H, n_ranges, n_pblocks, tokens_per_program, n_scale_tiles, scale_cols,
        R=R, P=P, **meta, HAS_Z=has_z, **host_utils.sigmoid_units(dout), SCALED_RAW_Y=scaled,
        HAS_D=has_d, num_warps=num_warps, num_stages=1,
        # The D skip's v tiles and D Psi took it from 128 to 166 registers (3 CTAs an SM instead of 4); capped, it
        # spills 0-56 B on the official shapes (aot_report.py, d_in_gate=1).
        **({"maxnreg": D_SKIP_MAX_REGISTERS} if has_d else {}),
    )
    return dphi, dzeta
