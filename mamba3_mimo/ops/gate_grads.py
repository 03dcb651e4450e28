"""Stage 4 of the split output path: the gradients of the output projection and of the SiLU gate.

``out[t, p] = sum_r Phi[r, p] silu(z[t, p] Zeta[r, p]) raw_y[t, r, p]`` is linear in ``raw_y``
given z, so once ``chunk_scan`` has stored raw_y the gradients are a streaming pass over tokens:

    dPhi[r, p]  = sum_t gate raw_y dout                 (per token block, summed by ``sum_group_partials``)
    dL/du       = dout Phi raw_y silu'(u),  u = z Zeta
    dz[t, p]    = sum_r dL/du Zeta[r, p],   dZeta[r, p] = sum_t dL/du z[t, p]

One program owns one (b, h) and a block of tokens, all P columns, and walks the ranks: each rank's
token sums are complete in the program, and dz is a running sum over ranks.
"""

import torch
import triton
import triton.language as tl

from .host_utils import cdiv, next_power_of_2
from .triton_utils import load_rows, silu_and_grad

# Elements of one [tokens, P] tile: 16 per thread at 4 warps; capped at 128 registers (no spill as compiled for
# sm_90), 4 CTAs per SM (the prefetch of the next rank's tile took it to 167 uncapped).  Fewer
# elements per thread cost more instructions each (the token sums cross threads once per rank); 4096 at 8
# warps with the rank loop unrolled took 138 registers (1 CTA per SM) and moved 0.7 TB/s on
# N128_P64_R4_C16 (173 us, sweep of 898b281).
TILE_ELEMENTS = 2048


@triton.jit
def _gate_grads_kernel(
    raw_y_ptr, dout_ptr, z_ptr, phi_ptr, zeta_ptr, dz_ptr, dphi_ptr, dzeta_ptr,
    S, H, N_BLOCKS,
    R: tl.constexpr, P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, HAS_Z: tl.constexpr,
):
    block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < S
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < P

    hp_seq = (b * S * H + h) * P  # [B, S, H, P] activations at (b, 0, h, 0)
    tok_offs = t * (H * P)
    dout = load_rows(dout_ptr + hp_seq, tok_offs, t_mask, offs_p, p_mask)
    z = load_rows(z_ptr + hp_seq, tok_offs, t_mask & HAS_Z, offs_p, p_mask)
    dz = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    tile_mask = t_mask[:, None] & p_mask[None, :]
    y_rows = raw_y_ptr + bh * S * R * P + t[:, None] * (R * P) + offs_p[None, :]
    part = (bh * N_BLOCKS + block) * R * P + offs_p
    y_next = tl.load(y_rows, mask=tile_mask, other=0.0)
    for r in range(R):  # not unrolled: one rank's tiles live at a time, several programs per SM
        raw_y = y_next.to(tl.float32)
        # The next rank's tile is in flight while this rank's gate math runs.
        y_next = tl.load(y_rows + (r + 1) * P, mask=tile_mask & (r + 1 < R), other=0.0)
        phi_r = tl.load(phi_ptr + (h * R + r) * P + offs_p, mask=p_mask, other=0.0)
        y_dout = raw_y * dout
        if HAS_Z:
            zeta_r = tl.load(zeta_ptr + (h * R + r) * P + offs_p, mask=p_mask, other=0.0)
            gate, dgate = silu_and_grad(z * zeta_r[None, :])
            du_over_phi = y_dout * dgate  # dL/du without its Phi factor, which is constant over tokens
            tl.store(dphi_ptr + part + r * P, tl.sum(gate * y_dout, axis=0), mask=p_mask)
            tl.store(dzeta_ptr + part + r * P, phi_r * tl.sum(du_over_phi * z, axis=0), mask=p_mask)
            dz += du_over_phi * (phi_r * zeta_r)[None, :]
        else:
            tl.store(dphi_ptr + part + r * P, tl.sum(y_dout, axis=0), mask=p_mask)
    if HAS_Z:
        tl.store(dz_ptr + hp_seq + tok_offs[:, None] + offs_p[None, :], dz.to(dz_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & p_mask[None, :])


def gate_grads(*, raw_y, dout, z, mimo_o, mimo_z, dz, num_warps=4):
    """Write ``dz`` and return the per-token-block partials of dPhi and dZeta.

    Args (contiguous): raw_y: [B, H, S, R, P] from ``chunk_scan``; dout, z: [B, S, H, P] (z may be
        None); mimo_o, mimo_z: [H, R, P] fp32 (mimo_z None with z); dz: [B, S, H, P] or None.
    Returns:
        dphi_partial, dzeta_partial: [B, H, n_blocks, R, P] fp32 (dzeta_partial None without Z), to be
        summed over dim 2 by ``sum_group_partials``.
    """
    B, H, S, R, P = raw_y.shape
    block_p = next_power_of_2(P)
    block_t = max(16, min(128, TILE_ELEMENTS // block_p))
    n_blocks = cdiv(S, block_t)
    has_z = z is not None
    dphi = torch.empty((B, H, n_blocks, R, P), device=raw_y.device, dtype=torch.float32)
    dzeta = torch.empty_like(dphi) if has_z else None
    _gate_grads_kernel[(n_blocks, B * H)](
        raw_y, dout, z if has_z else dout, mimo_o, mimo_z if has_z else mimo_o, dz if has_z else dout,
        dphi, dzeta if has_z else dphi, S, H, n_blocks,
        R=R, P=P, BLOCK_T=block_t, BLOCK_P=block_p, HAS_Z=has_z, num_warps=num_warps, num_stages=1, maxnreg=128,
    )
    return dphi, dzeta
