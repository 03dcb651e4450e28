"""Random, realistic inputs for ``mamba3_mimo_bwd_fwd_kernel`` and the discretization they need.

Shapes follow SPEC section 2: batch ``B``, sequence ``S``, heads ``H``, query/key groups ``G``,
query/key dim ``N``, value dim ``P``, MIMO rank ``R``, chunk ``C``, ``nch = ceil(S / C)`` and
``RD = N // rotary_dim_divisor``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["build_discretization", "make_inputs"]


def build_discretization(dA: Tensor, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Chunk-local decay tensors from the per-token log decay.

    Args:
        dA: [B, H, S] per-token log decay (<= 0 in practice).
        chunk_size: C >= 1. The last chunk may be partial.

    Returns:
        da_cs:     [B, H, S] inclusive cumsum of dA that restarts at every t % C == 0.
        da_cs_rev: [B, H, S] da_cs[last valid position of t's chunk] - da_cs[t].
        segsum:    [B, H, nch, C, C]; segsum[..., c, i, j] = da_cs[cC+i] - da_cs[cC+j] for i > j
                   when both positions are < S, else 0.

    Everything is computed in dA's dtype. The cumsum adds one position at a time, so its rounding
    is the plain left-to-right sum on every device, and segsum / da_cs_rev are single
    subtractions of da_cs values: a kernel that derives them from da_cs gets the same bits.
    """
    if dA.dim() != 3:
        raise ValueError(f"dA must be [B, H, S], got shape {tuple(dA.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    B, H, S = dA.shape
    C = chunk_size
    nch = -(-S // C)
    pad = nch * C - S

    # Zero padding keeps the valid prefix sums unchanged; padded entries are masked below.
    dA_chunks = torch.nn.functional.pad(dA, (0, pad)).reshape(B, H, nch, C)
    running = torch.zeros_like(dA_chunks[..., 0])
    prefix = []
    for i in range(C):
        running = running + dA_chunks[..., i]
        prefix.append(running)
    da_cs_chunks = torch.stack(prefix, dim=-1)  # [B, H, nch, C]

    position = torch.arange(nch * C, device=dA.device).reshape(nch, C)
    valid = position < S  # [nch, C]
    last_valid = valid.sum(-1) - 1  # [nch], index of each chunk's last valid position
    da_cs_last = da_cs_chunks.gather(-1, last_valid.expand(B, H, nch)[..., None])  # [B,H,nch,1]
    da_cs_rev_chunks = da_cs_last - da_cs_chunks

    lower = torch.ones(C, C, dtype=torch.bool, device=dA.device).tril(-1)
    keep = lower & valid[:, :, None] & valid[:, None, :]  # [nch, C, C]
    segsum = da_cs_chunks[..., :, None] - da_cs_chunks[..., None, :]
    segsum = torch.where(keep, segsum, torch.zeros_like(segsum))

    da_cs = da_cs_chunks.reshape(B, H, nch * C)[..., :S]
    da_cs_rev = da_cs_rev_chunks.reshape(B, H, nch * C)[..., :S]
    return da_cs.contiguous(), da_cs_rev.contiguous(), segsum


def make_inputs(
    B: int = 2,
    S: int = 64,
    H: int = 4,
    G: int = 1,
    N: int = 32,
    P: int = 32,
    R: int = 2,
    chunk_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    z: bool = True,
    d: bool = True,
    device: str | torch.device = "cpu",
    seed: int = 0,
    rotary_dim_divisor: int = 4,
    dA_scale: float = 1.0,
    dt_range: tuple[float, float] = (1e-3, 1e-1),
    trap_scale: float = 1.0,
    z_scale: float = 1.0,
    return_dA: bool = False,
):
    """Keyword arguments of ``mamba3_mimo_bwd_fwd_kernel(**inputs)`` (and of the references).

    Returned tensors (activations in ``dtype``, everything else fp32):
        dout, v, z:          [B, S, H, P]      (z None when z=False)
        q, k:                [B, S, R, G, N]
        q_bias, k_bias:      [H, R, N]
        mimo_v, mimo_o:      [H, R, P]         Psi, Phi
        mimo_z:              [H, R, P] or None Zeta (None when z=False)
        d:                   [H] or None       (None when d=False)
        angles:              [B, S, H, RD]
        da_cs, da_cs_rev:    [B, H, S]
        dt:                  [B, H, S] fp32;   trap: [B, H, S] in ``dtype``
        segsum:              [B, H, nch, C, C]
    plus ``chunk_size`` and ``rotary_dim_divisor``.

    Every tensor is drawn on the CPU in fp32 from one generator seeded with ``seed``, in a fixed
    order that does not depend on ``z``/``d`` (turning the gate off leaves the other values
    unchanged), then rounded to its dtype and moved to ``device``: CPU and GPU runs see the same
    numbers.

    With ``return_dA=True`` the result is ``(inputs, dA)`` where dA [B, H, S] fp32 (on
    ``device``) is the per-token log decay that da_cs, da_cs_rev and segsum were built from.
    """
    if N % 2 or N // rotary_dim_divisor > N // 2:
        raise ValueError(f"need N even and N // rotary_dim_divisor <= N / 2, got N={N}, "
                         f"rotary_dim_divisor={rotary_dim_divisor}")
    if H % G:
        raise ValueError(f"H ({H}) must be a multiple of G ({G})")
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    def uniform(low, high, *shape):
        return low + (high - low) * torch.rand(shape, generator=gen, dtype=torch.float32)

    rd = N // rotary_dim_divisor
    # q, k entries with variance 1/sqrt(N) make q . k (a sum of N products) O(1).
    qk_scale = N ** -0.25
    q = normal(B, S, R, G, N) * qk_scale
    k = normal(B, S, R, G, N) * qk_scale
    q_bias = 0.1 * normal(H, R, N)
    k_bias = 0.1 * normal(H, R, N)
    v = normal(B, S, H, P)
    dout = normal(B, S, H, P)
    gate_in = z_scale * normal(B, S, H, P)
    # Psi feeds a sum over R ranks into the state and Phi a sum over R ranks into the output:
    # 1/sqrt(R) keeps both sums O(1) whatever R is. Zeta only scales the gate input of one rank,
    # so it stays N(0, 1) and the SiLU works in its curved range, not its linear tail.
    rank_scale = R ** -0.5
    mimo_v = normal(H, R, P) * rank_scale
    mimo_o = normal(H, R, P) * rank_scale
    mimo_z = normal(H, R, P)
    d_skip = normal(H)

    # Step sizes log-uniform over dt_range, decay rates A in [1, 16] per head (Mamba's A range).
    log_dt_lo, log_dt_hi = math.log(dt_range[0]), math.log(dt_range[1])
    dt = torch.exp(uniform(log_dt_lo, log_dt_hi, B, H, S))
    a_log = uniform(math.log(1.0), math.log(16.0), H)
    dA = -dt * torch.exp(a_log)[None, :, None] * dA_scale
    trap = trap_scale * normal(B, H, S)
    # RoPE-style frequencies, advanced by dt instead of by 1 per token.
    frequencies = 10000.0 ** (-torch.arange(rd, dtype=torch.float32) / rd)
    angles = torch.cumsum(dt[..., None] * frequencies, dim=2)  # [B, H, S, RD]
    angles = angles.permute(0, 2, 1, 3).contiguous()  # [B, S, H, RD]

    da_cs, da_cs_rev, segsum = build_discretization(dA, chunk_size)

    def act(x):
        return x.to(dtype).to(device)

    def param(x):
        return x.to(device)

    inputs = dict(
        dout=act(dout), q=act(q), k=act(k), v=act(v),
        q_bias=param(q_bias), k_bias=param(k_bias),
        mimo_v=param(mimo_v), mimo_o=param(mimo_o), angles=param(angles),
        da_cs=param(da_cs), da_cs_rev=param(da_cs_rev), dt=param(dt), trap=act(trap),
        segsum=param(segsum),
        mimo_z=param(mimo_z) if z else None,
        d=param(d_skip) if d else None,
        z=act(gate_in) if z else None,
        chunk_size=chunk_size, rotary_dim_divisor=rotary_dim_divisor,
    )
    if return_dA:
        return inputs, param(dA)
    return inputs
