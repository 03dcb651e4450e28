"""PyTorch references for the Mamba-3 MIMO ``bwd_fwd`` pass (SPEC section 3).

Two independent scans compute the same outputs:

- ``bwd_fwd_reference``: the chunked formulas, written as in the spec with the given
  ``da_cs``, ``da_cs_rev`` and ``segsum`` (this is the golden in float64, and the bench when run in
  the input dtype);
- ``bwd_fwd_recurrent_reference``: the token-by-token recurrence, which only uses the per-token
  decay recovered from ``da_cs``.

Both share the input preparation (casting, head gather, bias, psiv), the rotation, and the
autograd of the output projections; the recurrences are written separately. Nothing here imports
triton, and no input is modified.

Internal layout: heads before time, ``[B, H, S, ...]``; outputs are returned in SPEC layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["bwd_fwd_reference", "bwd_fwd_recurrent_reference"]


@dataclass
class _Prepared:
    """Inputs cast to the compute dtype, heads before time.

    qb, kb: [B, H, S, R, N] biased, not rotated; angles: [B, H, S, RD]; psiv: [B, H, S, R, P];
    phi, zeta: [H, R, P] (zeta None without gate); d: [H] or None; z, dout: [B, S, H, P];
    da_cs, da_cs_rev, dt, trap: [B, H, S]; segsum: [B, H, nch, C, C].
    """

    qb: Tensor
    kb: Tensor
    angles: Tensor
    psiv: Tensor
    phi: Tensor
    zeta: Tensor | None
    d: Tensor | None
    z: Tensor | None
    dout: Tensor
    da_cs: Tensor
    da_cs_rev: Tensor
    dt: Tensor
    trap: Tensor
    segsum: Tensor
    chunk_size: int


def _biased_heads(x: Tensor, bias: Tensor) -> Tensor:
    """x [B, S, R, G, N], bias [H, R, N] -> [B, H, S, R, N]; head h reads group h // (H / G)."""
    H, G = bias.shape[0], x.shape[3]
    group_of_head = torch.arange(H, device=x.device) // (H // G)
    per_head = x.index_select(3, group_of_head)  # [B, S, R, H, N]
    return per_head.permute(0, 3, 1, 2, 4) + bias[None, :, None]


def _rotate_half(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate the pairs (n, N/2 + n), n < RD, of x [B, H, S, R, N] by angles [B, H, S, RD]."""
    half, rd = x.shape[-1] // 2, angles.shape[-1]
    cos = torch.cos(angles)[:, :, :, None]  # broadcast over ranks
    sin = torch.sin(angles)[:, :, :, None]
    lo, hi = x[..., :rd], x[..., half:half + rd]
    return torch.cat(
        [cos * lo - sin * hi, x[..., rd:half], sin * lo + cos * hi, x[..., half + rd:]], dim=-1)


def _prepare(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
             segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, compute_dtype) -> _Prepared:
    if (mimo_z is None) != (z is None):
        raise ValueError("mimo_z and z must be given together or not at all")
    if mimo_o is None:
        raise ValueError("mimo_o is required")
    H, G = q_bias.shape[0], q.shape[3]
    if H % G:
        raise ValueError(f"H ({H}, from q_bias) must be a multiple of G ({G}, from q)")
    rd = q.shape[-1] // rotary_dim_divisor
    if angles.shape[-1] != rd:
        raise ValueError(f"angles must have RD = N // rotary_dim_divisor = {rd} entries in its "
                         f"last dim, got shape {tuple(angles.shape)}")

    def cast(x):
        return None if x is None else x.detach().to(compute_dtype)

    v_heads = cast(v).permute(0, 2, 1, 3)  # [B, H, S, P]
    psi = cast(mimo_v)
    return _Prepared(
        qb=_biased_heads(cast(q), cast(q_bias)),
        kb=_biased_heads(cast(k), cast(k_bias)),
        angles=cast(angles).permute(0, 2, 1, 3),
        psiv=v_heads[:, :, :, None, :] * psi[None, :, None],
        phi=cast(mimo_o), zeta=cast(mimo_z), d=cast(d), z=cast(z), dout=cast(dout),
        da_cs=cast(da_cs), da_cs_rev=cast(da_cs_rev), dt=cast(dt), trap=cast(trap),
        segsum=cast(segsum), chunk_size=chunk_size,
    )


def _gated_output(raw_y: Tensor, phi: Tensor, zeta: Tensor | None, z: Tensor | None) -> Tensor:
    """out [B, S, H, P] = sum_r Phi gate raw_y.

    raw_y: [B, H, S, R, P]; phi, zeta: [B, H, R, P] or [H, R, P] (shared over the batch);
    z: [B, S, H, P] or None (then gate = 1).
    """
    def per_batch(param):
        return (param if param.dim() == 4 else param[None])[:, :, None]  # [B|1, H, 1, R, P]

    y = per_batch(phi) * raw_y
    if z is not None:
        gate_in = z.permute(0, 2, 1, 3)[:, :, :, None, :] * per_batch(zeta)
        y = y * F.silu(gate_in)
    return y.sum(3).permute(0, 2, 1, 3)


def _projection_grads(raw_y: Tensor, x: _Prepared):
    """dmimo_o, dmimo_z ([B, H, R, P], per batch element) and dz [B, S, H, P] by autograd.

    Phi and Zeta get one copy per batch element as leaves, so autograd returns the per-batch
    gradients the kernel writes (the caller sums over B). dmimo_z and dz are None without gate.
    """
    B = raw_y.shape[0]

    def leaf(param):
        return param.expand(B, *param.shape).clone().requires_grad_(True)

    phi = leaf(x.phi)
    leaves = [phi]
    zeta = z = None
    if x.z is not None:
        zeta, z = leaf(x.zeta), x.z.clone().requires_grad_(True)
        leaves += [zeta, z]
    with torch.enable_grad():
        out = _gated_output(raw_y.detach(), phi, zeta, z)
        grads = torch.autograd.grad(out, leaves, grad_outputs=x.dout)
    if x.z is None:
        return grads[0], None, None
    return grads


def _chunk_groups(S: int, C: int) -> list[tuple[int, int, int]]:
    """Cover positions 0..S-1 by runs of equal-length chunks: (first chunk, chunk count, length).

    At most two runs: the whole chunks, then the partial last chunk.
    """
    groups = []
    if S // C:
        groups.append((0, S // C, C))
    if S % C:
        groups.append((S // C, 1, S % C))
    return groups


def _as_chunks(x: Tensor, first_chunk: int, n_chunks: int, length: int, C: int) -> Tensor:
    """[B, H, S, *rest] -> [B, H, n_chunks, length, *rest] for the given run of chunks."""
    start = first_chunk * C
    part = x[:, :, start:start + n_chunks * length]
    return part.reshape(*x.shape[:2], n_chunks, length, *x.shape[3:])


@torch.no_grad()
def _chunked_scan(x: _Prepared):
    """Chunked recomputation. Returns states [B,H,nch,N,P], qk_dot [B,H,S,R,R], raw_y [B,H,S,R,P]."""
    B, H, S, R, N = x.qb.shape
    P = x.psiv.shape[-1]
    C = x.chunk_size
    nch = -(-S // C)
    q_rot, k_rot = _rotate_half(x.qb, x.angles), _rotate_half(x.kb, x.angles)
    # Same-token products need no rotation: both sides turn by the same angle.
    qk_dot = torch.einsum("bhsrn,bhsun->bhsru", x.qb, x.kb)

    gamma = x.dt * torch.sigmoid(x.trap)
    # gamma'[t] is the next token's share of token t's input; none after the last token.
    gamma_next = x.dt[..., 1:] * torch.sigmoid(-x.trap[..., 1:])
    ts = gamma + torch.cat([gamma_next, torch.zeros_like(gamma[..., :1])], dim=-1)

    groups = _chunk_groups(S, C)

    # Per chunk: decay over the whole chunk and the chunk's own contribution to the next state.
    chunk_decay, chunk_input = [], []
    for run in groups:
        k_c = _as_chunks(k_rot, *run, C)  # [B, H, n, L, R, N]
        psiv_c = _as_chunks(x.psiv, *run, C)
        weight = torch.exp(_as_chunks(x.da_cs_rev, *run, C)) * _as_chunks(ts, *run, C)
        chunk_input.append(torch.einsum("bhclrn,bhcl,bhclrp->bhcnp", k_c, weight, psiv_c))
        chunk_decay.append(torch.exp(_as_chunks(x.da_cs, *run, C)[..., -1]))  # last valid
    chunk_decay = torch.cat(chunk_decay, dim=2)  # [B, H, nch]
    chunk_input = torch.cat(chunk_input, dim=2)  # [B, H, nch, N, P]

    state_in = torch.zeros(B, H, N, P, dtype=x.psiv.dtype, device=x.psiv.device)
    states = []
    for c in range(nch):
        states.append(state_in)
        state_in = chunk_decay[:, :, c, None, None] * state_in + chunk_input[:, :, c]
    states = torch.stack(states, dim=2)

    raw_y = []
    for first_chunk, n_chunks, length in groups:
        run = (first_chunk, n_chunks, length)
        q_c, k_c = _as_chunks(q_rot, *run, C), _as_chunks(k_rot, *run, C)
        psiv_c = _as_chunks(x.psiv, *run, C)
        state_c = states[:, :, first_chunk:first_chunk + n_chunks]
        from_state = torch.exp(_as_chunks(x.da_cs, *run, C))[..., None, None] * torch.einsum(
            "bhclrn,bhcnp->bhclrp", q_c, state_c)

        # Earlier tokens s < t of the same chunk, weighted by ts[s] exp(segsum[t, s]).
        segsum_c = x.segsum[:, :, first_chunk:first_chunk + n_chunks, :length, :length]
        earlier = torch.ones(length, length, dtype=torch.bool, device=q_c.device).tril(-1)
        pair_weight = torch.exp(segsum_c) * _as_chunks(ts, *run, C)[:, :, :, None, :]
        pair_weight = torch.where(earlier, pair_weight, torch.zeros_like(pair_weight))
        scores = torch.einsum("bhctrn,bhcsun->bhctsru", q_c, k_c)
        from_earlier = torch.einsum("bhctsru,bhcts,bhcsup->bhctrp", scores, pair_weight, psiv_c)

        # The token itself enters with gamma[t] only (its gamma' share goes to the next token).
        gamma_c = _as_chunks(gamma, *run, C)
        from_self = gamma_c[..., None, None] * torch.einsum(
            "bhclru,bhclup->bhclrp", _as_chunks(qk_dot, *run, C), psiv_c)

        y_c = from_state + from_earlier + from_self
        if x.d is not None:
            y_c = y_c + x.d[None, :, None, None, None, None] * psiv_c
        raw_y.append(y_c.reshape(B, H, n_chunks * length, R, P))
    raw_y = torch.cat(raw_y, dim=2)
    return states, qk_dot, raw_y


@torch.no_grad()
def _recurrent_scan(x: _Prepared):
    """Token-by-token recomputation. Same outputs as ``_chunked_scan``."""
    B, H, S, R, N = x.qb.shape
    P = x.psiv.shape[-1]
    C = x.chunk_size
    q_rot, k_rot = _rotate_half(x.qb, x.angles), _rotate_half(x.kb, x.angles)
    qk_dot = (x.qb[..., :, None, :] * x.kb[..., None, :, :]).sum(-1)

    # Per-token log decay: da_cs restarts at chunk starts, otherwise differences of neighbours.
    chunk_start = (torch.arange(S, device=x.da_cs.device) % C) == 0
    da_cs_prev = torch.cat([torch.zeros_like(x.da_cs[..., :1]), x.da_cs[..., :-1]], dim=-1)
    alpha = torch.exp(torch.where(chunk_start, x.da_cs, x.da_cs - da_cs_prev))
    gamma = x.dt * torch.sigmoid(x.trap)
    carry = x.dt * torch.sigmoid(-x.trap)  # weight at t of token t-1's input

    state = torch.zeros(B, H, N, P, dtype=x.psiv.dtype, device=x.psiv.device)
    prev_input = torch.zeros_like(state)  # k~_{t-1}^T psiv_{t-1}
    states, raw_y = [], []
    for t in range(S):
        token_input = torch.einsum("bhrn,bhrp->bhnp", k_rot[:, :, t], x.psiv[:, :, t])
        carried = state + carry[:, :, t, None, None] * prev_input
        if t % C == 0:
            states.append(carried)
        state = alpha[:, :, t, None, None] * carried + gamma[:, :, t, None, None] * token_input
        y_t = torch.einsum("bhrn,bhnp->bhrp", q_rot[:, :, t], state)
        if x.d is not None:
            y_t = y_t + x.d[None, :, None, None] * x.psiv[:, :, t]
        raw_y.append(y_t)
        prev_input = token_input
    return torch.stack(states, dim=2), qk_dot, torch.stack(raw_y, dim=2)


def _run(scan, args, compute_dtype):
    x = _prepare(*args, compute_dtype)
    states, qk_dot, raw_y = scan(x)
    dmimo_o, dmimo_z, dz = _projection_grads(raw_y, x)
    return states, qk_dot, dmimo_o, dmimo_z, dz


def bwd_fwd_reference(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev,
                      dt, trap, segsum, mimo_z=None, d=None, z=None, chunk_size=16,
                      rotary_dim_divisor=4, compute_dtype=torch.float64):
    """Chunked reference of ``mamba3_mimo_bwd_fwd_kernel`` (inputs as in SPEC section 2).

    Every input is cast to ``compute_dtype`` and every op runs in it: float64 gives the golden,
    the input dtype gives the bench of SPEC section 7. bf16 and fp16 run on the CPU as well:
    every op used here (einsum, exp, sin/cos, sigmoid, silu and its autograd) has CPU kernels for
    both in torch 2.13, so no op needs an fp32 detour.
    A partial last chunk is handled as such, without padding.

    Returns, in ``compute_dtype``:
        states  [B, H, nch, N, P]  state entering each chunk
        qk_dot  [B, H, S, R, R]
        dmimo_o [B, H, R, P]       per batch element
        dmimo_z [B, H, R, P] or None
        dz      [B, S, H, P] or None
    """
    args = (dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
            segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor)
    return _run(_chunked_scan, args, compute_dtype)


def bwd_fwd_recurrent_reference(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs,
                                da_cs_rev, dt, trap, segsum, mimo_z=None, d=None, z=None,
                                chunk_size=16, rotary_dim_divisor=4,
                                compute_dtype=torch.float64):
    """Token-by-token reference; same arguments and outputs as ``bwd_fwd_reference``.

    It ignores ``da_cs_rev`` and ``segsum`` and uses only the per-token decay recovered from
    ``da_cs``, so it checks the chunked formulas rather than repeating them.
    """
    args = (dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
            segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor)
    return _run(_recurrent_scan, args, compute_dtype)
