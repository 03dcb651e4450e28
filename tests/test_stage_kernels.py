"""The small production stages on their own, against torch: the token tables, the segment fold, the
gate gradients and the group sum.

The composed path is checked against the float64 reference in test_kernels.py; here each of the
short kernels is checked alone, with shapes that leave partial tiles, so a bug shows where it is.
"""

import dataclasses
import math

import pytest
import torch

import torch.nn.functional as F
import triton.language as tl

from conftest import seed_for
import mamba3_mimo.api as api
from mamba3_mimo.api import bwd_fwd
from mamba3_mimo.inputs import build_discretization, make_inputs
from mamba3_mimo.ops import gluon_state_scan, group_sum, production
from mamba3_mimo.ops.chunk_state import segment_end_states
from mamba3_mimo.ops.chunk_output import chunk_output
from mamba3_mimo.ops.chunk_scan import chunk_scan
from mamba3_mimo.ops.gate_grads import gate_grads, gate_grads_meta
from mamba3_mimo.ops.group_sum import sum_group_partials
from mamba3_mimo.ops.span_decays import span_decays
from mamba3_mimo.ops.state_passing import segment_entry_states
from mamba3_mimo.ops.token_tables import token_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("tile", ["default", "wide"])
@pytest.mark.parametrize("n_groups,R,P", [(1, 1, 16), (45, 3, 40), (128, 4, 64), (130, 2, 24), (300, 2, 24)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_z", [True, False])
def test_sum_group_partials(request, n_groups, R, P, out_dtype, has_z, tile):
    """Group counts past one step of 64 (256 for the wide tile) and R*P past one tile of 32 (partial
    tiles), both outputs."""
    gen = torch.Generator().manual_seed(seed_for(request.node.nodeid))
    B, H = 2, 3
    dphi = torch.randn((B, H, n_groups, R, P), generator=gen, dtype=torch.float32).to(DEVICE)
    dzeta = torch.randn((B, H, n_groups, R, P), generator=gen, dtype=torch.float32).to(DEVICE) if has_z else None
    dmimo_o = torch.full((B, H, R, P), float("nan"), dtype=out_dtype, device=DEVICE)
    dmimo_z = torch.full((B, H, R, P), float("nan"), dtype=out_dtype, device=DEVICE) if has_z else None
    dphi_before = dphi.clone()
    sum_group_partials(dphi_partial=dphi, dzeta_partial=dzeta, dmimo_o=dmimo_o, dmimo_z=dmimo_z,
                       **(group_sum.WIDE_TILE if tile == "wide" else {}))
    pairs = [(dphi, dmimo_o)] + ([(dzeta, dmimo_z)] if has_z else [])
    for partial, out in pairs:
        expected = partial.double().sum(dim=2)
        # fp32 sums of up to 300 unit normals: ~1e-6 absolute; bf16 outputs: one rounding.
        tol = 1e-5 if out_dtype == torch.float32 else 2 ** -8 * expected.abs().max().item()
        torch.testing.assert_close(out.double(), expected, atol=tol, rtol=1e-2 if out_dtype != torch.float32 else 1e-5)
    assert torch.equal(dphi, dphi_before)


@pytest.mark.parametrize("one_scan", [False, True], ids=["serial", "one-scan"])
@pytest.mark.parametrize("S,C,chunks_per_segment,n_segments", [(70, 16, 2, 3), (64, 8, 3, 3), (256, 16, 4, 4),
                                                               (256, 8, 2, 16)])
def test_segment_entry_states(request, S, C, chunks_per_segment, n_segments, one_scan):
    """entry_0 = 0, entry_{s+1} = exp(segment log decay) entry_s + end_s, with partial state tiles; the
    returned table holds each chunk's decay from its segment's start (a partial last segment and chunk).  Both
    folds: the serial walk over the segments and the one associative scan over them (a partial tile of segments
    at 3, sixteen segments, where its state tiles narrow to 256 elements)."""
    gen = torch.Generator().manual_seed(seed_for(request.node.nodeid))
    B, H, N, P = 2, 2, 24, 48  # N * P = 1152: one full and one partial tile of 1024
    nch = math.ceil(S / C)
    assert (n_segments - 1) * chunks_per_segment < nch <= n_segments * chunks_per_segment
    da = -torch.rand((B, H, S), generator=gen, dtype=torch.float32) * 0.3
    da_cs = torch.cat([da[..., c * C:(c + 1) * C].cumsum(-1) for c in range(nch)], dim=-1)
    ends = torch.randn((B, H, n_segments, N, P), generator=gen, dtype=torch.float32)
    seg_state = ends.clone().to(DEVICE)
    entry_decay = segment_entry_states(seg_state=seg_state, da_cs=da_cs.to(DEVICE), chunk_size=C,
                                       chunks_per_segment=chunks_per_segment, one_scan=one_scan)
    assert entry_decay.shape == (B, H, nch) and entry_decay.dtype == torch.float32
    chunk_log_decay = da_cs[..., [min(c * C + C - 1, S - 1) for c in range(nch)]].double()
    for c in range(nch):
        first = c // chunks_per_segment * chunks_per_segment
        log_want = chunk_log_decay[..., first:c].sum(-1)
        # fp32 sums of the log decays, then exp: a relative error of ~2^-23 |log decay| plus the exp's few ulps (the
        # H200 gave 1.03e-6 at |log decay| ~ 6 with a flat 1e-6; a chunk off by one is off by ~1e-2 or more).
        rtol = 2 ** -21 * (1 + log_want.abs().max().item())
        torch.testing.assert_close(entry_decay[..., c].cpu().double(), log_want.exp(), atol=0, rtol=rtol)
    entry = torch.zeros((B, H, N, P), dtype=torch.float64)
    for s in range(n_segments):
        torch.testing.assert_close(seg_state[:, :, s].cpu().double(), entry, atol=1e-5, rtol=1e-5)
        chunk_ends = [min(c * C + C - 1, S - 1) for c in range(s * chunks_per_segment, (s + 1) * chunks_per_segment)]
        decay = da_cs[..., chunk_ends].double().sum(-1).exp()
        entry = entry * decay[..., None, None] + ends[:, :, s].double()


@pytest.mark.parametrize("S,RD", [(1, 4), (37, 3), (1500, 32), (300, 64)])
@pytest.mark.parametrize("trap_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotation_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("flat", [False, True])
def test_token_tables(request, S, RD, trap_dtype, rotation_dtype, flat):
    """gamma = dt sigmoid(trap), trap_scale = gamma + next dt sigmoid(-next trap) (none after S - 1), and
    cos / sin of the angles, over partial token blocks, RD not a power of two and angles far from 0; per (b, h)
    and token block, or flat (a row's last token has no next one although the next row's first follows it)."""
    gen = torch.Generator().manual_seed(seed_for(request.node.nodeid))
    B, H = 2, 3
    dt = torch.rand((B, H, S), generator=gen, dtype=torch.float32) * 0.5
    trap = torch.randn((B, H, S), generator=gen, dtype=torch.float32).to(trap_dtype)
    angles = torch.randn((B, S, H, RD), generator=gen, dtype=torch.float32) * 200.0
    dt_dev, trap_dev, angles_dev = dt.to(DEVICE), trap.to(DEVICE), angles.to(DEVICE)
    gamma, trap_scale, cos_angles, sin_angles = token_tables(dt=dt_dev, trap=trap_dev, angles=angles_dev,
                                                             rotation_dtype=rotation_dtype, flat=flat)
    t = trap.double()
    want_gamma = dt.double() * torch.sigmoid(t)
    nxt = F.pad(dt.double()[..., 1:] * torch.sigmoid(-t[..., 1:]), (0, 1))
    torch.testing.assert_close(gamma.cpu().double(), want_gamma, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(trap_scale.cpu().double(), want_gamma + nxt, atol=1e-6, rtol=1e-5)
    # fp32 angles of a few hundred radians.  fp32 tables: within 2e-7, a couple of fp32 units (libdevice on the GPU,
    # numpy in the interpreter); the approximate units' 2^-20.9 would fail it.  16-bit tables: within 2e-6 before
    # their rounding (the GPU reduces by 2 pi in three parts, then takes the approximate units), which is at most
    # 2^-12 absolute for |values| <= 1 in fp16, 2^-9 in bf16 (2^-8 in the interpreter, which truncates to bf16).
    atol = {torch.float32: 2e-7, torch.float16: 2e-6 + 2 ** -12, torch.bfloat16: 2e-6 + 2 ** -8}[rotation_dtype]
    for table, want in ((cos_angles, angles.double().cos()), (sin_angles, angles.double().sin())):
        assert table.dtype == rotation_dtype
        torch.testing.assert_close(table.cpu().double(), want, atol=atol, rtol=0)
    assert cos_angles.shape == sin_angles.shape == angles.shape and cos_angles.is_contiguous()
    assert torch.equal(dt_dev.cpu(), dt) and torch.equal(trap_dev.cpu(), trap) and torch.equal(angles_dev.cpu(), angles)


@pytest.mark.parametrize("S,C,span", [(64, 8, 2), (72, 8, 4), (50, 16, 2), (256, 16, 2), (40, 8, 8)])
def test_span_decays_are_those_of_the_spans(request, S, C, span):
    """da_cs / da_cs_rev of C-token chunks turned into those of spans of ``span`` chunks equal the ones built for
    chunks of span * C tokens from the per-token decays (a partial last chunk and span, one span past S at 8);
    the inputs are not modified."""
    gen = torch.Generator().manual_seed(seed_for(request.node.nodeid))
    dA = -torch.rand((2, 3, S), generator=gen, dtype=torch.float64)
    da_cs, da_cs_rev, _ = build_discretization(dA, C)
    want_cs, want_rev, _ = build_discretization(dA, span * C)
    given_cs, given_rev = da_cs.float().to(DEVICE), da_cs_rev.float().to(DEVICE)
    got_cs, got_rev = span_decays(da_cs=given_cs, da_cs_rev=given_rev, chunk_size=C, span_chunks=span)
    assert got_cs.shape == got_rev.shape == (2, 3, S) and got_cs.dtype == got_rev.dtype == torch.float32
    # fp32 sums of up to 64 terms of |dA| < 1: a few 2^-24 of |sum| <= 64; a chunk counted in the wrong span or
    # twice is off by its whole log decay (~C / 2).
    torch.testing.assert_close(got_cs.cpu().double(), want_cs, rtol=0, atol=2e-5)
    torch.testing.assert_close(got_rev.cpu().double(), want_rev, rtol=0, atol=2e-5)
    assert torch.equal(given_cs.cpu(), da_cs.float()) and torch.equal(given_rev.cpu(), da_cs_rev.float())


def test_span_decays_of_one_chunk_are_the_inputs():
    da_cs, da_cs_rev = torch.zeros((1, 2, 8)), torch.ones((1, 2, 8))
    assert span_decays(da_cs=da_cs, da_cs_rev=da_cs_rev, chunk_size=4, span_chunks=1) == (da_cs, da_cs_rev)
    with pytest.raises(ValueError, match="span_chunks must be >= 1"):
        span_decays(da_cs=da_cs, da_cs_rev=da_cs_rev, chunk_size=4, span_chunks=0)


def _scan_arguments(inputs, *, n_segments, chunks_per_segment, block_p):
    """The state-scan arguments production_bwd_fwd builds (fp32 tables and products: the interpreter)."""
    gamma, trap_scale, cos_angles, sin_angles = token_tables(dt=inputs["dt"], trap=inputs["trap"],
                                                             angles=inputs["angles"])
    return dict(k=inputs["k"], v=inputs["v"], cos_angles=cos_angles, sin_angles=sin_angles, k_bias=inputs["k_bias"],
                mimo_v=inputs["mimo_v"], da_cs=inputs["da_cs"], da_cs_rev=inputs["da_cs_rev"], gamma=gamma,
                trap_scale=trap_scale, chunk_size=inputs["chunk_size"], n_segments=n_segments,
                chunks_per_segment=chunks_per_segment, block_half=16, block_p=block_p, dot_dtype=tl.float32,
                dot_precision="ieee", num_warps=4, max_registers=0, prefetch=False, skip_unrotated=False,
                rotation_math_dtype=tl.float32)


@pytest.mark.parametrize("span", [2, 4])
def test_end_states_over_span_chunks_are_those_over_chunks(span):
    """The identity the Gluon end-state pass's spans rest on (``production._end_pass_scan``): the segment end-state
    scan over chunks of span * C tokens on ``span_decays``' tables gives the end states it gives over C-token chunks
    (here the Triton scan, one chunk a step both ways; 3 segments of 8 chunks, the last one short)."""
    inputs = make_inputs(B=1, S=160, H=2, G=1, N=32, P=16, R=2, chunk_size=8, dtype=torch.float32, seed=11,
                         device=DEVICE)
    scan = _scan_arguments(inputs, n_segments=3, chunks_per_segment=8, block_p=16)
    want = segment_end_states(**scan)
    span_cs, span_rev = span_decays(da_cs=scan["da_cs"], da_cs_rev=scan["da_cs_rev"], chunk_size=8, span_chunks=span)
    got = segment_end_states(**dict(scan, chunk_size=8 * span, chunks_per_segment=8 // span, da_cs=span_cs,
                                    da_cs_rev=span_rev))
    assert want.abs()[:, :, :2].amax() > 0.1  # the two end states that are read are not trivial
    torch.testing.assert_close(got[:, :, :2], want[:, :, :2], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case,span,covered", [
    ("N128_P64_R4_C16", 2, True), ("N64_P128_R4_C16", 2, True), ("N128_P64_R8_C8", 2, True),
    ("N128_P32_R4_C16", 2, True), ("N64_P64_R4_C16", 4, False), ("N128_P64_R2_C32", 2, False)])
def test_end_pass_scan_takes_spans_where_the_kernel_covers_them(case, span, covered):
    """``_end_pass_scan``: with ``end_span_chunks`` the Gluon end-state pass runs at chunks of span * C tokens on the
    spans' decay tables, with segments of as many fewer steps, where one ring stage of that chunk fits 99 KB
    without state stores (R2_C32's 64-token span and N64_P64's four 16-token chunks do not: 106 and 115 KB);
    else its arguments are the caller's.  Host-side: the coverage rule and the tables (in the interpreter here)."""
    shape = {name: int(part[1:]) for name, part in zip(("N", "P", "R", "chunk_size"), case.split("_"))}
    C, S = shape["chunk_size"], 4 * span * shape["chunk_size"]
    inputs = make_inputs(B=1, S=S, H=2, G=1, N=shape["N"], P=shape["P"], R=shape["R"], chunk_size=C,
                         dtype=torch.bfloat16, seed=2, device=DEVICE)
    scan = _scan_arguments(inputs, n_segments=2, chunks_per_segment=2 * span, block_p=min(shape["P"], 64))
    scan.update(cos_angles=scan["cos_angles"].half(), sin_angles=scan["sin_angles"].half())
    config = production.ScanConfig(block_p=64, n_segments=2, block_half=64, out_block_p=64, end_span_chunks=span)
    got = production._end_pass_scan(config, gluon_state_scan, scan=scan)
    if not covered:
        assert got is scan
        return
    want_cs, want_rev = span_decays(da_cs=scan["da_cs"], da_cs_rev=scan["da_cs_rev"], chunk_size=C, span_chunks=span)
    assert got["chunk_size"] == span * C and got["chunks_per_segment"] == 2 and got["n_segments"] == 2
    assert torch.equal(got["da_cs"], want_cs) and torch.equal(got["da_cs_rev"], want_rev)
    assert {name: got[name] for name in got if name not in ("chunk_size", "chunks_per_segment", "da_cs",
                                                             "da_cs_rev")} == {
        name: scan[name] for name in scan if name not in ("chunk_size", "chunks_per_segment", "da_cs", "da_cs_rev")}
    # One span: the caller's arguments; a segment that is not whole spans: the same.
    assert production._end_pass_scan(dataclasses.replace(config, end_span_chunks=1), gluon_state_scan,
                                     scan=scan) is scan
    assert production._end_pass_scan(config, gluon_state_scan, scan=dict(scan, chunks_per_segment=2 * span + 1))[
        "chunk_size"] == C


@pytest.mark.parametrize("dtype,want", [(torch.bfloat16, torch.float16), (torch.float16, torch.float32),
                                        (torch.float32, torch.float32)])
def test_production_rotation_table_dtype(monkeypatch, dtype, want):
    """The production path asks for fp16 cos / sin tables exactly where the products take bf16 operands."""
    # Check mode: every call runs its wrappers (no whole-call replay), so token_tables is called.
    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")
    asked = []

    def recording_tables(**kwargs):
        asked.append(kwargs["rotation_dtype"])
        return token_tables(**kwargs)

    monkeypatch.setattr(production, "token_tables", recording_tables)
    inputs = make_inputs(B=1, S=24, H=2, N=16, P=16, R=2, chunk_size=8, dtype=dtype, device=DEVICE, seed=7)
    # Without the swept rule's half rotation, which asks for tables in the products' dtype where both stages rotate
    # in it (test_production_half_rotation_dtypes): on the GPU that is bf16 here.
    config = production.choose_config(B=1, H=2, S=24, N=16, P=16, R=2, chunk_size=8, num_sms=4, swept_knobs=False)
    bwd_fwd(**inputs, impl="production", config=config)
    assert asked == [want]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scan_half,out_half", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("split_gate", [True, False])
def test_production_half_rotation_dtypes(monkeypatch, dtype, scan_half, out_half, split_gate):
    """scan_half_rotation / out_half_rotation give the state scans / the output stage the products' dtype for the
    rotation where it is 16-bit (fp16 in the interpreter for fp16 activations; bf16 only on the GPU), and the tables
    that dtype only when both stages take it."""
    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")  # every call runs its wrappers
    seen = {}

    def recording(name, wrapped):
        def record(**kwargs):
            seen.setdefault(name, set()).add(kwargs.get("rotation_math_dtype", kwargs.get("rotation_dtype")))
            return wrapped(**kwargs)
        monkeypatch.setattr(production, name, record)

    for name in ("token_tables", "segment_end_states", "chunk_states", "chunk_scan", "chunk_output"):
        recording(name, getattr(production, name))
    inputs = make_inputs(B=1, S=24, H=2, N=16, P=16, R=2, chunk_size=8, dtype=dtype, device=DEVICE, seed=7)
    config = production.ScanConfig(block_p=16, n_segments=2, out_block_p=16, split_gate=split_gate,
                                   scan_half_rotation=scan_half, out_half_rotation=out_half)
    bwd_fwd(**inputs, impl="production", config=config)
    dot_dtype, _ = api.dot_operands([dtype], torch.device(DEVICE))
    half = dot_dtype in (tl.bfloat16, tl.float16)
    scan_math = dot_dtype if half and scan_half else tl.float32
    out_math = dot_dtype if half and out_half else tl.float32
    tables = production.rotation_table_dtype(dtype)
    if half and scan_half and out_half:
        tables = torch.bfloat16 if dot_dtype == tl.bfloat16 else torch.float16
    assert seen.pop("token_tables") == {tables}
    assert seen.pop("segment_end_states") == seen.pop("chunk_states") == {scan_math}
    assert seen == {"chunk_scan" if split_gate else "chunk_output": {out_math}}


@pytest.mark.parametrize("scan_prefetch,end_prefetch", [(False, False), (False, True), (True, False), (True, True)])
def test_production_end_scan_prefetch(monkeypatch, scan_prefetch, end_prefetch):
    """end_scan_prefetch makes the end-state pass load a step ahead and leaves the storing pass as scan_prefetch has
    it; the one-pass schedule (local states) has no end-state pass to give it to."""
    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")  # every call runs its wrappers
    seen = {}

    def recording(name, wrapped):
        def record(**kwargs):
            seen.setdefault(name, []).append(kwargs["prefetch"])
            return wrapped(**kwargs)
        monkeypatch.setattr(production, name, record)

    for name in ("segment_end_states", "chunk_states", "chunk_local_states"):
        recording(name, getattr(production, name))
    inputs = make_inputs(B=1, S=40, H=2, N=16, P=16, R=2, chunk_size=8, dtype=torch.float32, device=DEVICE, seed=7)
    for local_states in (False, True):
        config = production.ScanConfig(block_p=16, n_segments=2, out_block_p=16, local_states=local_states,
                                       scan_prefetch=scan_prefetch, end_scan_prefetch=end_prefetch)
        bwd_fwd(**inputs, impl="production", config=config)
    assert seen == {"segment_end_states": [scan_prefetch or end_prefetch], "chunk_states": [scan_prefetch],
                    "chunk_local_states": [scan_prefetch]}


@pytest.mark.parametrize("dtype,want", [(torch.bfloat16, torch.float16), (torch.float16, torch.float32),
                                        (torch.float32, torch.float32)])
@pytest.mark.parametrize("half_raw_y", [True, False])
def test_production_raw_y_scratch_dtype(monkeypatch, dtype, want, half_raw_y):
    """The split output stage hands gate_grads an fp16 raw_y with its row scales exactly where the products take
    bf16 operands (and ``half_raw_y`` is on), else fp32 without scales."""
    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")  # every call runs its wrappers
    handed = []

    def recording_gate_grads(**kwargs):
        handed.append((kwargs["raw_y"].dtype, kwargs["raw_y_scale"] is not None))
        return gate_grads(**kwargs)

    monkeypatch.setattr(production, "gate_grads", recording_gate_grads)
    inputs = make_inputs(B=1, S=24, H=2, N=16, P=16, R=2, chunk_size=8, dtype=dtype, device=DEVICE, seed=7)
    config = production.ScanConfig(block_p=16, n_segments=1, out_block_p=16, split_gate=True, half_raw_y=half_raw_y)
    bwd_fwd(**inputs, impl="production", config=config)
    scratch = want if half_raw_y else torch.float32
    assert handed == [(scratch, scratch == torch.float16)]


def encode_raw_y(raw_y, scale_block_p):
    """chunk_scan's fp16 scratch of an fp32 raw_y [B, H, S, R, P]: each row and P tile of ``scale_block_p``
    columns scaled by the power of two that puts its largest magnitude in [2^14, 2^15); (fp16, inverse scales)."""
    B, H, S, R, P = raw_y.shape
    tiles = -(-P // scale_block_p)
    padded = torch.nn.functional.pad(raw_y.double(), (0, tiles * scale_block_p - P))
    row_max = padded.view(B, H, S, R, tiles, scale_block_p).abs().amax(-1)
    unscale = 2.0 ** (torch.floor(torch.log2(row_max.clamp_min(2.0**-100))) - 14)
    scaled = padded.view(B, H, S, R, tiles, scale_block_p) / unscale[..., None]
    return scaled.reshape(B, H, S, R, -1)[..., :P].to(torch.float16), unscale.float()


@pytest.mark.parametrize("S,R,P", [(100, 3, 40), (64, 1, 64), (33, 4, 128), (40, 8, 48)])
@pytest.mark.parametrize("has_z", [True, False])
@pytest.mark.parametrize("tokens_per_program", [64, 20])
@pytest.mark.parametrize("scratch", ["fp32", "fp16"])
@pytest.mark.parametrize("has_d", [False, True])
def test_gate_grads(request, S, R, P, has_z, tokens_per_program, scratch, has_d):
    """dz, and the per-range partials of dPhi / dZeta summed over ranges, against the formulas of
    SPEC section 3 in float64: partial token blocks and ranges, several ranges (20 tokens, rounded up
    to whole tiles), two P blocks (P = 128; P = 48 at R = 8, whose blocks are 32 wide), a partial P
    block, ranks not a power of two.  The fp16 scratch with row scales per P tile of 32 columns (two to
    four scale tiles, the blocks narrowed to them) or 64 (P = 40 and 48: one partial tile), decoded exactly.
    With ``has_d`` raw_y comes without the D skip and gate_grads adds D v Psi."""
    check_gate_grads(seed_for(request.node.nodeid), S, R, P, has_z, tokens_per_program, scratch, has_d)


@pytest.mark.parametrize("S,R,P", [(100, 3, 40), (40, 8, 48)])
@pytest.mark.parametrize("tile_elements,num_warps", [(512, 4), (1024, 4), (4096, 8)])
def test_gate_grads_tile_sizes(request, S, R, P, tile_elements, num_warps):
    """The other tile sizes and warp counts the sweep offers (ScanConfig.gate_tile_elements /
    gate_num_warps): tiles of 1-16 tokens, with Z, D, the fp16 scratch and several token ranges."""
    check_gate_grads(seed_for(request.node.nodeid), S, R, P, True, 20, "fp16", True, tile_elements=tile_elements,
                     num_warps=num_warps)


def check_gate_grads(seed, S, R, P, has_z, tokens_per_program, scratch, has_d, **tiling):
    gen = torch.Generator().manual_seed(seed)
    B, H = 2, 2
    raw_y = torch.randn((B, H, S, R, P), generator=gen, dtype=torch.float32)
    # Rows of very different magnitudes, so that a wrong row's scale shows.
    raw_y *= 2.0 ** torch.randint(-4, 5, (B, H, S, R, 1), generator=gen)
    scaled = {}
    if scratch == "fp16":
        scale_block_p = 32 if P in (64, 128) else 64
        fp16_y, unscale = encode_raw_y(raw_y, scale_block_p)
        tiles = unscale.repeat_interleave(scale_block_p, dim=-1)[..., :P]
        raw_y = (fp16_y.double() * tiles.double()).float()  # exact: what the kernel decodes
        scaled = dict(raw_y_scale=unscale.to(DEVICE), scale_block_p=scale_block_p)
    dout = torch.randn((B, S, H, P), generator=gen, dtype=torch.float32)
    z = torch.randn((B, S, H, P), generator=gen, dtype=torch.float32) if has_z else None
    phi = torch.randn((H, R, P), generator=gen, dtype=torch.float32)
    zeta = torch.randn((H, R, P), generator=gen, dtype=torch.float32) if has_z else None
    dz = torch.full((B, S, H, P), float("nan"), device=DEVICE) if has_z else None

    def dev(x):
        return None if x is None else x.to(DEVICE)

    skip = {}
    if has_d:
        v = torch.randn((B, S, H, P), generator=gen, dtype=torch.float32)
        psi = torch.randn((H, R, P), generator=gen, dtype=torch.float32)
        d = torch.randn((H,), generator=gen, dtype=torch.float32)
        skip = dict(v=dev(v), mimo_v=dev(psi), d=dev(d))
    stored = dev(fp16_y) if scratch == "fp16" else dev(raw_y)
    dphi_part, dzeta_part = gate_grads(raw_y=stored, dout=dev(dout), z=dev(z), mimo_o=dev(phi), mimo_z=dev(zeta),
                                       dz=dz, tokens_per_program=tokens_per_program, **scaled, **skip, **tiling)
    block_t = gate_grads_meta(R=R, P=P, **({"max_block_p": scaled["scale_block_p"]} if scaled else {}),
                              **({"tile_elements": tiling["tile_elements"]} if tiling else {}))["BLOCK_T"]
    range_tokens = -(-tokens_per_program // block_t) * block_t
    assert dphi_part.shape == (B, H, -(-S // range_tokens), R, P)
    y = raw_y.double()
    if has_d:  # [B, H, S, R, P]
        y = y + d.double()[None, :, None, None, None] * v.double().permute(0, 2, 1, 3)[:, :, :, None] * \
            psi.double()[None, :, None]
    g = dout.double().permute(0, 2, 1, 3)[:, :, :, None]  # [B, H, S, 1, P]

    def close(got, want):  # fp32 sums of terms up to 2^4 times their neighbours'
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)

    if has_z:
        u = z.double().permute(0, 2, 1, 3)[:, :, :, None] * zeta.double()[None, :, None]
        sig = torch.sigmoid(u)
        gate, dgate = u * sig, sig * (1 + u * (1 - sig))
        du = g * phi.double()[None, :, None] * y * dgate
        want_dz = (du * zeta.double()[None, :, None]).sum(3).permute(0, 2, 1, 3)
        want_dzeta = (du * z.double().permute(0, 2, 1, 3)[:, :, :, None]).sum(2)
        close(dz.cpu().double(), want_dz)
        close(dzeta_part.cpu().double().sum(2), want_dzeta)
    else:
        gate = torch.ones_like(y)
        assert dzeta_part is None
    close(dphi_part.cpu().double().sum(2), (gate * y * g).sum(2))


@pytest.mark.parametrize("R", [1, 2, 3, 4, 8, 16])
def test_gate_grads_meta_keeps_ranks_in_a_warp(R):
    """A tile's ranks times its 8-column lanes fit one warp (dz's rank sum without shared memory), with
    2048-element tiles: R = 8 takes 32 columns where R <= 4 takes 64."""
    meta = gate_grads_meta(R=R, P=128)
    assert meta["BLOCK_R"] * meta["BLOCK_P"] // 8 <= 32
    assert meta["BLOCK_P"] == {8: 32, 16: 16}.get(R, 64)
    assert meta["BLOCK_R"] * meta["BLOCK_T"] * meta["BLOCK_P"] == 2048


def _chunk_scan_stub(d=None):
    """chunk_scan's tensor arguments at a tiny shape (B=1, S=4, R=G=H=1, N=P=16) for its host-side refusals, and the
    [B, S, R, G, N] / [B, S, H, P] tensors a test adds (raw_y, dout)."""
    x = torch.zeros(1, 4, 1, 1, 16)
    act = torch.zeros(1, 4, 1, 16)
    tensors = dict(q=x, k=x, v=act, cos_angles=act, sin_angles=act, q_bias=x, k_bias=x, mimo_v=act, d=d,
                   da_cs=act, da_cs_rev=act, gamma=act, trap_scale=act, states=x, qk_dot=x)
    return tensors, x, act


@pytest.mark.parametrize("give", ["both", "neither"])
def test_chunk_scan_takes_raw_y_or_dout(give):
    """chunk_scan fills the raw_y scratch or applies the gate (dout): exactly one, refused before any launch."""
    tensors, x, act = _chunk_scan_stub()
    chosen = dict(raw_y=x, dout=act) if give == "both" else {}
    with pytest.raises(ValueError, match="raw_y .* or dout"):
        chunk_scan(**tensors, **chosen, chunk_size=4, block_p=16, dot_dtype=None, dot_precision=None)


def test_chunk_scan_d_in_gate_needs_the_gate():
    """d_in_gate moves the D skip into the gate's math: with a raw_y scratch to fill there is no gate, refused."""
    tensors, x, _ = _chunk_scan_stub(d=torch.zeros(1))
    with pytest.raises(ValueError, match="d_in_gate applies with dout"):
        chunk_scan(**tensors, raw_y=x, chunk_size=4, block_p=16, dot_dtype=None, dot_precision=None, d_in_gate=True)


@pytest.mark.parametrize("stage", ["chunk_scan", "chunk_output"])
@pytest.mark.parametrize("give", ["seg_entry", "entry_decay"])
def test_output_stages_take_entry_states_with_their_decays(stage, give):
    """The segment entry states and the per-chunk decay table come together (both from segment_entry_states):
    one without the other is refused before any launch."""
    x = torch.zeros(1, 4, 1, 1, 16)
    act = torch.zeros(1, 4, 1, 16)
    tensors = dict(q=x, k=x, v=act, cos_angles=act, sin_angles=act, q_bias=x, k_bias=x, mimo_v=act, d=None,
                   da_cs=act, da_cs_rev=act, gamma=act, trap_scale=act, states=x, qk_dot=x, chunk_size=4,
                   block_p=16, dot_dtype=None, dot_precision=None, **{give: x})
    with pytest.raises(ValueError, match="seg_entry and entry_decay go together"):
        if stage == "chunk_scan":
            chunk_scan(**tensors, raw_y=x)
        else:
            chunk_output(**tensors, dout=act, z=None, mimo_o=act, mimo_z=None, dz=None, chunks_per_program=1)


@pytest.mark.parametrize("given,match", [
    (dict(d="d"), "go together"), (dict(v="act", mimo_v="head"), "go together"),
    (dict(v="act", d="d"), "go together"), (dict(tile_elements=3000), "tile_elements")])
def test_gate_grads_refuses_partial_d_skip_and_bad_tiles(given, match):
    """The D skip added in gate_grads needs v, Psi and D together, and a tile is a power of two: refused before
    any launch."""
    B, H, S, R, P = 1, 2, 8, 2, 16
    tensors = dict(act=torch.zeros((B, S, H, P)), head=torch.zeros((H, R, P)), d=torch.zeros((H,)))
    kwargs = {k: tensors[v] if isinstance(v, str) else v for k, v in given.items()}
    with pytest.raises(ValueError, match=match):
        gate_grads(raw_y=torch.zeros((B, H, S, R, P)), dout=tensors["act"], z=None, mimo_o=tensors["head"],
                   mimo_z=None, dz=None, **kwargs)


@pytest.mark.parametrize("bad", ["fp16 without scales", "scales of the wrong shape", "fp32 with scales", "bf16",
                                 "scale tile not a power of two"])
def test_raw_y_scratch_refused(bad):
    """chunk_scan and gate_grads take raw_y in fp32, or in fp16 with its [B, H, S, R, P tiles] fp32 row scales;
    anything else is refused before any launch."""
    B, H, S, R, P = 1, 2, 8, 2, 48
    raw_y = torch.zeros((B, H, S, R, P), dtype=torch.float16 if bad != "fp32 with scales" else torch.float32)
    scale = torch.zeros((B, H, S, R, 1))
    given = {"fp16 without scales": dict(raw_y_scale=None, scale_block_p=64),
             "scales of the wrong shape": dict(raw_y_scale=torch.zeros((B, H, S, R, 2)), scale_block_p=64),
             "fp32 with scales": dict(raw_y_scale=scale, scale_block_p=64),
             "bf16": dict(raw_y_scale=scale, scale_block_p=64),
             "scale tile not a power of two": dict(raw_y_scale=scale, scale_block_p=48)}[bad]
    if bad == "bf16":
        raw_y = raw_y.to(torch.bfloat16)
    act = torch.zeros((B, S, H, P))
    with pytest.raises(ValueError, match="raw_y"):
        gate_grads(raw_y=raw_y, dout=act, z=None, mimo_o=torch.zeros((H, R, P)), mimo_z=None, dz=None, **given)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("knobs", [dict(local_states=True, n_segments=3),
                                   dict(local_states=True, n_segments=3, gate_in_scan=True, out_span_chunks=2),
                                   dict(local_states=False, n_segments=2, scan_half_rotation=True,
                                        out_half_rotation=True)],
                         ids=["local", "gate-in-scan-spans", "two-pass-half-rotation"])
def test_angles_in_kernels_computes_the_tables_values(monkeypatch, dtype, knobs):
    """``ScanConfig.angles_in_kernels``: chunk_scan takes the angles, not the cos / sin tables, and computes the values
    the tables would hold, so every output is bit for bit the tables' call.  (Under the interpreter the Triton scans
    run, so ``token_tables`` still writes the tables for them; the Gluon scan's side is checked on the GPU by
    tests/test_gluon_state_scan.py.)"""
    from conftest import assert_knob_inert

    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")  # every call runs its wrappers
    taken = []
    chunk_scan = production.chunk_scan

    def record(**kwargs):
        taken.append((kwargs.get("angles") is not None, kwargs["cos_angles"] is None, kwargs.get("table_dtype")))
        return chunk_scan(**kwargs)

    monkeypatch.setattr(production, "chunk_scan", record)
    inputs = make_inputs(B=1, S=40, H=2, N=16, P=16, R=2, chunk_size=8, dtype=dtype, device=DEVICE, seed=19)
    base = production.ScanConfig(block_p=16, out_block_p=16, split_gate=True, **knobs)
    assert_knob_inert(inputs, base, "angles_in_kernels")
    tables = production.rotation_table_dtype(dtype)
    if knobs.get("out_half_rotation"):
        dot_dtype, _ = api.dot_operands([dtype], torch.device(DEVICE))
        tables = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}.get(dot_dtype, tables)
    # fp32 tables (fp16 activations with an fp32 rotation) stay tables.
    assert taken == [(False, False, None), (True, True, tables) if tables != torch.float32 else (False, False, None)]


def test_angles_in_kernels_leaves_fp32_tables_and_the_fused_stage_alone(monkeypatch):
    """fp32 tables (fp32 activations: libdevice's cos / sin) and the fused output stage keep the tables: the knob is
    inert there, bit for bit, and no kernel is handed the angles."""
    from conftest import assert_knob_inert

    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")
    handed = []
    for name in ("chunk_scan", "chunk_output"):
        wrapped = getattr(production, name)
        monkeypatch.setattr(production, name, lambda _wrapped=wrapped, **kwargs: (
            handed.append(kwargs.get("angles") is not None), _wrapped(**kwargs))[1])
    fp32 = make_inputs(B=1, S=24, H=2, N=16, P=16, R=2, chunk_size=8, dtype=torch.float32, device=DEVICE, seed=5)
    assert_knob_inert(fp32, production.ScanConfig(block_p=16, n_segments=2, out_block_p=16, split_gate=True),
                      "angles_in_kernels", output_dtype=torch.float32)
    bf16 = make_inputs(B=1, S=24, H=2, N=16, P=16, R=2, chunk_size=8, dtype=torch.bfloat16, device=DEVICE, seed=5)
    assert_knob_inert(bf16, production.ScanConfig(block_p=16, n_segments=2, out_block_p=16, split_gate=False),
                      "angles_in_kernels")
    assert handed == [False] * 4
