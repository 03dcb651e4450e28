"""The production bwd_fwd: segment end states, then the fused chunk scan, split over P tiles.

``choose_config`` is the shape dispatcher: it picks the P tile (register
budget of the [N, BLOCK_P] state) and the number of sequence segments
(parallelism when B * H * P-tiles is too small to fill the GPU).  Every config
covers the whole contract, so the choice is about speed only.
"""

from dataclasses import dataclass

import torch
import triton

from .chunk_scan import chunk_scan
from .chunk_state import segment_end_states

# Fp32 elements of the [N, BLOCK_P] state one program keeps in registers.
STATE_TILE_BUDGET = 8192
# Fewest chunks a segment should hold: below that the fold and the extra pass cost more than they give.
MIN_CHUNKS_PER_SEGMENT = 8


@dataclass(frozen=True)
class ScanConfig:
    """Launch shape of the production scan: P tile, sequence segments, warps, pipeline stages."""

    block_p: int
    n_segments: int
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.block_p < 16 or self.block_p & (self.block_p - 1):
            raise ValueError(f"ScanConfig.block_p must be a power of two >= 16 (tl.dot), got {self.block_p}")
        if self.n_segments < 1:
            raise ValueError(f"ScanConfig.n_segments must be >= 1, got {self.n_segments}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"ScanConfig.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"ScanConfig.num_stages must be >= 1, got {self.num_stages}")


def choose_config(*, B, H, S, N, P, R, chunk_size, num_sms):
    """Pick P tile, segment count and launch shape for one problem (see docs/optimization.md)."""
    nch = triton.cdiv(S, chunk_size)
    n_pow = triton.next_power_of_2(N)
    block_p = min(max(16, triton.next_power_of_2(P)), max(16, STATE_TILE_BUDGET // n_pow))
    programs = B * H * triton.cdiv(P, block_p)
    # A power of two: the official chunk counts are powers of two, so segments come out equal.
    want_segments = triton.next_power_of_2(triton.cdiv(2 * num_sms, programs))
    n_segments = max(1, min(want_segments, nch // MIN_CHUNKS_PER_SEGMENT))
    rows = triton.next_power_of_2(chunk_size) * triton.next_power_of_2(R)
    num_warps = 8 if rows * block_p >= 64 * 64 or n_pow * block_p >= 8192 else 4
    return ScanConfig(block_p=block_p, n_segments=n_segments, num_warps=num_warps)


def production_bwd_fwd(*, q, k, v, dout, z, angles, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d,
                       da_cs, da_cs_rev, dt, trap, states, qk_dot, dmimo_o, dmimo_z, dz,
                       chunk_size, dot_dtype, dot_precision, config=None):
    """Fill every output in place (tensors as in ``stage0_bwd_fwd``; segsum is derived from da_cs)."""
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    if config is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        config = choose_config(B=B, H=H, S=S, N=N, P=P, R=R, chunk_size=chunk_size, num_sms=num_sms)
    nch = triton.cdiv(S, chunk_size)
    chunks_per_segment = triton.cdiv(nch, config.n_segments)
    n_segments = triton.cdiv(nch, chunks_per_segment)
    launch = dict(chunk_size=chunk_size, n_segments=n_segments, chunks_per_segment=chunks_per_segment,
                  block_p=config.block_p, dot_dtype=dot_dtype, dot_precision=dot_precision,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    seg_state = segment_end_states(k=k, v=v, angles=angles, k_bias=k_bias, mimo_v=mimo_v,
                                   da_cs=da_cs, da_cs_rev=da_cs_rev, dt=dt, trap=trap, **launch)
    dphi, dzeta = chunk_scan(q=q, k=k, v=v, dout=dout, z=z, angles=angles, q_bias=q_bias, k_bias=k_bias,
                             mimo_v=mimo_v, mimo_o=mimo_o, mimo_z=mimo_z, d=d,
                             da_cs=da_cs, da_cs_rev=da_cs_rev, dt=dt, trap=trap, seg_state=seg_state,
                             states=states, qk_dot=qk_dot, dz=dz, **launch)
    # Deterministic reduction of the per-segment partials (no atomics).
    dmimo_o.copy_(dphi.sum(dim=2))
    if dzeta is not None:
        dmimo_z.copy_(dzeta.sum(dim=2))
