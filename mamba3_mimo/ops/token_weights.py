"""Stage 0 of the production path: the per-token trapezoid weights, once per (b, h, t).

    gamma[t]      = dt[t] * sigmoid(trap[t])                          (weight of token t on itself)
    trap_scale[t] = gamma[t] + dt[t+1] * sigmoid(-trap[t+1])          (weight of token t on later tokens;
                                                                       no next token after S - 1)

Every later stage reads these two [B, H, S] fp32 tables instead of loading dt and trap at t and
t + 1 and taking two sigmoids for each (token, rank) row of every tile.
"""

import torch
import triton
import triton.language as tl

from .host_utils import cdiv
from .triton_utils import trapezoid_weights

BLOCK_TOKENS = 1024


@triton.jit
def _token_weights_kernel(dt_ptr, trap_ptr, gamma_ptr, trap_scale_ptr, S, BLOCK: tl.constexpr):
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = t < S
    next_valid = (t + 1) < S
    seq = bh * S
    dt = tl.load(dt_ptr + seq + t, mask=valid, other=0.0).to(tl.float32)
    trap = tl.load(trap_ptr + seq + t, mask=valid, other=0.0).to(tl.float32)
    dt_next = tl.load(dt_ptr + seq + t + 1, mask=next_valid, other=0.0).to(tl.float32)
    trap_next = tl.load(trap_ptr + seq + t + 1, mask=next_valid, other=0.0).to(tl.float32)
    gamma, trap_scale = trapezoid_weights(dt, trap, dt_next, trap_next)
    tl.store(gamma_ptr + seq + t, gamma, mask=valid)
    tl.store(trap_scale_ptr + seq + t, trap_scale, mask=valid)


def token_weights(*, dt, trap):
    """(gamma, trap_scale), each [B, H, S] fp32, from dt [B, H, S] fp32 and trap [B, H, S] (contiguous)."""
    B, H, S = dt.shape
    gamma = torch.empty((B, H, S), device=dt.device, dtype=torch.float32)
    trap_scale = torch.empty_like(gamma)
    _token_weights_kernel[(cdiv(S, BLOCK_TOKENS), B * H)](dt, trap, gamma, trap_scale, S, BLOCK=BLOCK_TOKENS,
                                                          num_warps=4)
    return gamma, trap_scale
