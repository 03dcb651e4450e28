"""The small production stages on their own, against torch: the segment fold and the group sum.

The composed path is checked against the float64 reference in test_kernels.py; here each of the two
short kernels is checked alone, with shapes that leave partial tiles, so a bug shows where it is.
"""

import math

import pytest
import torch

from conftest import seed_for
from mamba3_mimo.ops.group_sum import sum_group_partials
from mamba3_mimo.ops.state_passing import segment_entry_states

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n_groups,R,P", [(1, 1, 16), (45, 3, 40), (128, 4, 64)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_z", [True, False])
def test_sum_group_partials(request, n_groups, R, P, out_dtype, has_z):
    """Group counts past one tile of 32 and R*P past one tile of 128 (partial tiles), both outputs."""
    gen = torch.Generator().manual_seed(seed_for(request.node.nodeid))
    B, H = 2, 3
    dphi = torch.randn((B, H, n_groups, R, P), generator=gen, dtype=torch.float32).to(DEVICE)
    dzeta = torch.randn((B, H, n_groups, R, P), generator=gen, dtype=torch.float32).to(DEVICE) if has_z else None
    dmimo_o = torch.full((B, H, R, P), float("nan"), dtype=out_dtype, device=DEVICE)
    dmimo_z = torch.full((B, H, R, P), float("nan"), dtype=out_dtype, device=DEVICE) if has_z else None
    dphi_before = dphi.clone()
    sum_group_partials(dphi_partial=dphi, dzeta_partial=dzeta, dmimo_o=dmimo_o, dmimo_z=dmimo_z)
    pairs = [(dphi, dmimo_o)] + ([(dzeta, dmimo_z)] if has_z else [])
    for partial, out in pairs:
        expected = partial.double().sum(dim=2)
        # fp32 sums of up to 128 unit normals: ~1e-6 absolute; bf16 outputs: one rounding.
        tol = 1e-5 if out_dtype == torch.float32 else 2 ** -8 * expected.abs().max().item()
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=1e-2 if out_dtype != torch.float32 else 1e-5)
    assert torch.equal(dphi, dphi_before)


@pytest.mark.parametrize("S,C,chunks_per_segment,n_segments", [(70, 16, 2, 3), (64, 8, 3, 3), (256, 16, 4, 4)])
def test_segment_entry_states(request, S, C, chunks_per_segment, n_segments):
    """entry_0 = 0, entry_{s+1} = exp(segment log decay) entry_s + end_s, with partial state tiles."""
    gen = torch.Generator().manual_seed(seed_for(request.node.nodeid))
    B, H, N, P = 2, 2, 24, 48  # N * P = 1152: one full and one partial tile of 1024
    nch = math.ceil(S / C)
    assert (n_segments - 1) * chunks_per_segment < nch <= n_segments * chunks_per_segment
    da = -torch.rand((B, H, S), generator=gen, dtype=torch.float32) * 0.3
    da_cs = torch.cat([da[..., c * C:(c + 1) * C].cumsum(-1) for c in range(nch)], dim=-1)
    ends = torch.randn((B, H, n_segments, N, P), generator=gen, dtype=torch.float32)
    seg_state = ends.clone().to(DEVICE)
    segment_entry_states(seg_state=seg_state, da_cs=da_cs.to(DEVICE), chunk_size=C,
                         chunks_per_segment=chunks_per_segment)
    entry = torch.zeros((B, H, N, P), dtype=torch.float64)
    for s in range(n_segments):
        torch.testing.assert_close(seg_state[:, :, s].cpu().double(), entry, atol=1e-5, rtol=1e-5)
        chunk_ends = [min(c * C + C - 1, S - 1) for c in range(s * chunks_per_segment, (s + 1) * chunks_per_segment)]
        decay = da_cs[..., chunk_ends].double().sum(-1).exp()
        entry = entry * decay[..., None, None] + ends[:, :, s].double()
