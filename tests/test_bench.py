"""CPU checks of the benchmark's pure parts: case names, sweep candidates, geomean."""

import dataclasses

import pytest
import torch

from mamba3_mimo.bench import OFFICIAL_CASES, geomean, launch_sequence, parse_case, sweep_configs
from mamba3_mimo.ops import production
from mamba3_mimo.ops.production import (HALF_TABLE_SCAN_RESIDENCY, PREFETCH_SCAN_RESIDENCY, RESIDENT_SCAN_PROGRAMS,
                                        WIDE_NARROW_SCAN_RESIDENCY,
                                        TWO_PASS_SCAN, ScanConfig, choose_config,
                                        gate_tokens_per_program)

SHAPE = dict(B=4, S=2048, H=16, N=64, P=128, R=4, chunk_size=16, num_sms=132)


def test_parse_case():
    assert parse_case("N128_P64_R8_C8") == dict(N=128, P=64, R=8, chunk_size=8)


def test_geomean():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)


def _moved(config, chosen):
    return {f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(chosen, f.name)}


def test_launch_sequence_tells_apart_the_launches_of_one_kernel():
    # Two calls of tables -> scan (end states) -> scan (storing) -> out, listed out of order.
    call = [("tables", 0.0, 10.0), ("scan", 20.0, 100.0), ("scan", 130.0, 300.0), ("out", 440.0, 50.0)]
    second = [(name, start + 1000.0, us + 2.0) for name, start, us in call]
    kernels = list(reversed(call + second))
    assert launch_sequence(kernels, 2) == [["tables", 11.0], ["scan", 101.0], ["scan", 301.0], ["out", 51.0]]
    # Calls that launched differently, or a count the calls do not divide, have no sequence.
    assert launch_sequence(call + [("out", 1000.0, 1.0), ("scan", 1010.0, 1.0), ("scan", 1020.0, 1.0),
                                   ("tables", 1030.0, 1.0)], 2) is None
    assert launch_sequence(call + second[:3], 2) is None
    assert launch_sequence([], 2) is None


def test_sweep_moves_one_knob_at_a_time():
    chosen, configs = sweep_configs(**SHAPE, knob_names=["out_block_p", "out_num_warps"])
    assert chosen == choose_config(**SHAPE) and chosen in configs
    assert all(len(_moved(c, chosen)) <= 1 for c in configs)
    assert {c.out_block_p for c in configs} == {32, 64, 128}
    assert {c.out_num_warps for c in configs} == {4, 8}  # 16 lost on every case swept (optimization.md 15)
    assert len(configs) == len(set(configs)) == 1 + 2 + 1


def test_sweep_moves_joined_knobs_together():
    chosen, configs = sweep_configs(**SHAPE, knob_names=["out_block_p+out_num_warps"])
    pairs = {(c.out_block_p, c.out_num_warps) for c in configs}
    assert pairs == {(p, w) for p in (32, 64, 128) for w in (4, 8)}
    assert all(_moved(c, chosen) <= {"out_block_p", "out_num_warps"} for c in configs)


def test_sweep_rejects_unknown_knobs():
    with pytest.raises(ValueError, match="unknown sweep knobs"):
        sweep_configs(**SHAPE, knob_names=["out_block_p+warps"])


def test_sweep_spans_stay_within_128_rows():
    shape = dict(SHAPE, N=128, P=64, R=4, chunk_size=8)
    _, configs = sweep_configs(**shape, knob_names=["out_span_chunks", "end_span_chunks", "state_span_chunks"])
    spans = {c.out_span_chunks for c in configs} | {c.end_span_chunks for c in configs}
    assert spans == {1, 2, 4} and all(s * 8 * 4 <= 128 for s in spans)
    assert {c.state_span_chunks for c in configs} == {1, 2, 4}


def test_sweep_drops_end_spans_of_the_one_pass_schedule():
    """With local states the end-state span does nothing, so the sweep does not time it twice; with the fused
    storing scan (which runs an end-state pass whatever local_states says) it keeps both spans."""
    shape = dict(SHAPE, N=32, P=64, R=4, chunk_size=16)
    chosen, configs = sweep_configs(**shape, knob_names=["local_states+end_span_chunks"])
    assert chosen.local_states and not chosen.scan_outputs
    local = [c for c in configs if c.local_states]
    assert [c.end_span_chunks for c in local] == [1]
    assert {c.end_span_chunks for c in configs if not c.local_states} == {1, 2}  # spans of <= 128 rows
    fused_shape = dict(SHAPE, N=64, P=64, R=4, chunk_size=16)
    chosen, configs = sweep_configs(**fused_shape, knob_names=["end_span_chunks"])
    assert chosen.local_states and chosen.scan_outputs
    assert {c.end_span_chunks for c in configs} == {1, 2}


def test_sweep_of_the_output_stage_starts_from_the_dispatchers_config_for_it():
    """Moving split_gate gives the config choose_config picks for that stage (warps, cap, schedule), and the
    fused candidates carry no gate_grads setting, so no two candidates time the same launches."""
    chosen, configs = sweep_configs(**SHAPE, knob_names=["split_gate+gate_tokens"])
    fused = [c for c in configs if not c.split_gate]
    split = [c for c in configs if c.split_gate]
    assert fused == [choose_config(**SHAPE, split_gate=False)]
    assert {dataclasses.replace(c, gate_tokens=1) for c in split} == {
        dataclasses.replace(choose_config(**SHAPE, split_gate=True), gate_tokens=1)}
    assert sorted(c.gate_tokens for c in split) == [32, 64, 128, 256, 512]


@pytest.mark.parametrize("N,P,has_z,split", [(16, 64, True, True), (16, 64, False, True), (32, 64, False, True),
                                             (64, 64, False, True), (64, 128, False, True), (128, 32, False, True),
                                             (8, 16, False, True)])
def test_dispatcher_output_stage(N, P, has_z, split):
    """The split stage everywhere, with Z or without (optimization.md 16, 23, 38); the fused one on request.  Its
    state tile is at most 128 x 64 on these shapes, so they take local states (one scan pass)."""
    shape = dict(SHAPE, N=N, P=P)
    config = choose_config(**shape, has_z=has_z)
    assert config.split_gate is split
    assert config.local_states
    assert config == choose_config(**shape, has_z=has_z, split_gate=split)


@pytest.mark.parametrize("N,P,has_z,cap", [(16, 64, True, 128), (64, 128, True, 128), (64, 64, False, 128),
                                           (128, 64, True, 168), (128, 64, False, 168), (256, 64, True, 0)])
def test_dispatcher_chunk_scan_register_cap(N, P, has_z, cap):
    """chunk_scan fits four programs an SM at N <= 64 (128 registers), three at N = 128 (168; four at 128 in the
    low-register order with the bf16 rotation of the swept rule); N = 256 runs uncapped (optimization.md 15, 23,
    30)."""
    if N == 128 and production.DISPATCH_SWEPT_KNOBS:
        cap = 128
    config = choose_config(**dict(SHAPE, N=N, P=P), has_z=has_z)
    assert config.split_gate and config.out_max_registers == cap


@pytest.mark.parametrize("half_tables", [True, False])
@pytest.mark.parametrize("has_z", [True, False])
@pytest.mark.parametrize("case", OFFICIAL_CASES)
def test_dispatcher_swept_knobs(case, has_z, half_tables):
    """With the knobs the sweeps of 01845e8 chose (optimization.md 30): the bf16 rotation with chunk_scan's
    low-register order on the local-state shapes with bf16 products, except where the scan loads ahead (N64_P128);
    not in the two-pass shapes (N256, N128_P128) but for chunk_scan's at N256 (section 46), nor with fp32 tables;
    the D skip in the gate's math on every split shape with P <= 64 (section 31); the Gluon state scan asked for
    everywhere (production runs it where it applies, section 33), and at N = 64 one wave of its programs for
    segments (section 34) over 64-wide P tiles (section 47); the Gluon gate_grads wherever gate_grads runs at R = 4
    or 8 and P <= 64 (sections 37, 39); the flat token tables (section 44); chunk_scan's deferred stores at N64_P64
    and N128_P128 (section 45); cos / sin from the angles where the Gluon scan runs, but at N128_P128 (section 50).
    Everything else as without them; the defaults take them."""
    shape = dict(B=4, H=16, S=2048, num_sms=132, has_z=has_z, half_tables=half_tables, **parse_case(case))
    config = choose_config(**shape, swept_knobs=True)
    plain = choose_config(**shape, swept_knobs=False)
    # The defaults follow DISPATCH_SWEPT_KNOBS, on since final_gpu.sh passed with the rule on (optimization.md 33).
    assert production.DISPATCH_SWEPT_KNOBS is True
    assert choose_config(**shape) == (config if production.DISPATCH_SWEPT_KNOBS else plain)
    knobs = ("d_in_gate", "scan_half_rotation", "out_half_rotation", "out_q_cast_early", "out_y_state_early",
             "gluon_scan", "gluon_gate", "gluon_segments", "fold_one_scan", "flat_tables", "out_defer_state_store",
             "out_defer_qk_dot", "out_token_weights", "out_early_mixing", "angles_in_kernels", "scan_outputs",
             "scan_outputs_gate", "scan_outputs_ring_weights",
             "scan_outputs_weights_ahead", "scan_outputs_token_weights", "block_p", "out_max_registers", "n_segments",
             "end_span_chunks",
             "out_span_chunks", "out_num_warps", "gate_in_scan", "gate_tokens")
    assert not any(getattr(plain, name) for name in knobs[:-8])
    # The Gluon scan's P tile at N = 64 is 64 wide (section 47); elsewhere the plain rule's.
    gluon_n64 = parse_case(case)["N"] == 64 and config.local_states
    assert config.block_p == (64 if gluon_n64 else plain.block_p)
    gluon_programs = 64 * -(-parse_case(case)["P"] // config.block_p)  # B * H * P tiles, one N piece at N = 64
    assert config.n_segments == (2 * 132 // gluon_programs if gluon_n64 else plain.n_segments)
    assert dataclasses.replace(config, **{name: getattr(plain, name) for name in knobs}) == plain
    half = half_tables and config.local_states and not config.scan_prefetch
    assert half is (half_tables and case not in ("N256_P64_R4_C8", "N128_P128_R4_C8", "N64_P128_R4_C16"))
    assert config.scan_half_rotation is half
    # chunk_scan's bf16 rotation and low-register order also in the two-pass N = 256 shape (H100, section 46).
    out_half = half or (half_tables and case == "N256_P64_R4_C8")
    assert config.out_half_rotation is config.out_q_cast_early is config.out_y_state_early is out_half
    assert config.d_in_gate is (config.split_gate and parse_case(case)["P"] <= 64)
    assert config.gluon_scan  # production runs it where gluon_state_scan.unsupported finds nothing against the call
    # The Gluon gate_grads wherever gate_grads runs at R = 4 or 8 and P <= 64 (sections 37, 39); R = 2 (a tie) and
    # P = 128 (a loss on the H200) keep the Triton kernel, but after the fused pass (N64_P128), which leaves gate_grads
    # the D skip (section 55).
    R, P = parse_case(case)["R"], parse_case(case)["P"]
    assert config.gluon_gate is (config.split_gate and not config.gate_in_scan and R in (4, 8)
                                 and (P <= 64 or config.scan_outputs))
    small_chunks = half and parse_case(case)["N"] <= 32 and parse_case(case)["chunk_size"] * R <= 32
    assert small_chunks is (half and case == "N16_P64_R4_C8")
    # N16 with the bf16 rotation: chunk_scan over single chunks at 2 warps and 96 registers, applying the gate with Z
    # too (section 43); elsewhere the gate goes in chunk_scan without Z and at R = 1 (section 18).
    # Without Z, the fused storing scan applying the gate itself where SCAN_OUTPUTS_WITHOUT_Z_P takes it, chunks of at
    # most 32 tokens (R1_C64 does not fit the kernel; sections 53, 55).
    fused = ("N128_P32_R4_C16", "N128_P64_R4_C16", "N128_P64_R8_C8", "N128_P64_R2_C32")
    fused_without_z = (not has_z and case in fused and P in production.SCAN_OUTPUTS_WITHOUT_Z_P
                       and parse_case(case)["chunk_size"] <= 32) or (not has_z and case == "N64_P64_R4_C16")
    # At N = 64 (both halves stacked, section 55): with Z at N64_P64 and N64_P128, without Z at N64_P64.
    fused_n64 = case in ("N64_P64_R4_C16", "N64_P128_R4_C16") and (has_z or case == "N64_P64_R4_C16")
    assert config.gate_in_scan is ((small_chunks or not has_z or R == 1) and not fused_without_z)
    assert plain.gate_in_scan is (not has_z or R == 1)
    # ... and after the fused pass at P = 128, which leaves it the D skip (N64_P128 with Z; section 55).
    assert config.gluon_gate is (((has_z or fused_without_z) and R in (4, 8) and P <= 64 and not small_chunks)
                                 or (has_z and case == "N64_P128_R4_C16"))
    # The Gluon two-pass scan in one segment, and the one-scan fold with local states (timed on an H100, section 40).
    assert config.gluon_segments == (0 if config.local_states else 1)
    assert config.fold_one_scan is config.local_states
    # The flat token tables everywhere (timed on an H100, section 44).
    assert config.flat_tables is True and plain.flat_tables is False
    # chunk_scan's deferred stores where each was timed to win (H100, section 45): the entering state at N64_P64 with
    # the bf16 rotation, qk_dot at N128_P128 with Z and without.
    assert config.out_defer_state_store is (half and case == "N64_P64_R4_C16")
    assert config.out_defer_qk_dot is (case == "N128_P128_R4_C8")
    # cos / sin from the angles where the Gluon scan runs (N >= 64), but at N128_P128 (H100, section 50).
    assert config.angles_in_kernels is (parse_case(case)["N"] >= 64 and case != "N128_P128_R4_C8")
    # The fused storing scan where one program's P tile is all of P, with the gate after it, at N = 128 and
    # C * R = 64 (sections 51, 52): at P = 32 and at P = 64 (its 64-wide tile).
    assert config.scan_outputs is ((has_z and case in fused and P in production.SCAN_OUTPUTS_P) or fused_without_z
                                   or fused_n64)
    # The gate inside that pass without Z only (with Z it lost, section 54); its per-token weights through the ring
    # at chunks of 16 tokens or more (section 55).
    assert config.scan_outputs_gate is fused_without_z
    assert config.scan_outputs_ring_weights is (config.scan_outputs and parse_case(case)["chunk_size"] >= 16
                                                and parse_case(case)["N"] == 128)
    # Its intra-chunk weights once a (row, column token) wherever it runs (sections 58, 60) but N128_P64_R4_C16
    # without Z (the gate and the decays ahead over a 64-wide tile: a loss).
    assert config.scan_outputs_token_weights is (config.scan_outputs and production.SCAN_OUTPUTS_TOKEN_WEIGHTS
                                                 and not (not has_z and case == "N128_P64_R4_C16"))
    # chunk_scan's weights once a (row, column token) where chunk_scan runs with R > 1 without Z, its scores weighed
    # before the v / Psi loads at R = 1 without Z (section 59; with Z both tie or lose).
    assert config.out_token_weights is (production.OUT_TOKEN_WEIGHTS and config.split_gate and not has_z
                                        and not config.scan_outputs and R > 1)
    assert config.out_early_mixing is (config.split_gate and not has_z and not config.scan_outputs and R == 1)
    # Its log decays a step ahead at N = 128 with 16-token chunks (section 58).
    assert config.scan_outputs_weights_ahead is (config.scan_outputs and parse_case(case)["chunk_size"] == 16
                                                 and parse_case(case)["N"] == 128)
    # Its end-state pass over spans of two chunks at N64_P128 (section 57); elsewhere the two-pass shapes' own spans.
    if config.scan_outputs:
        assert config.end_span_chunks == (2 if case == "N64_P128_R4_C16" else 1)
    # Programmatic dependent launch waits for a GPU sweep too (section 40).
    assert config.pdl is plain.pdl is False
    assert config.local_states is (case not in ("N256_P64_R4_C8", "N128_P128_R4_C8"))
    if config.split_gate:
        want_cap = {16: 96 if small_chunks else 128, 32: 128, 64: 128, 128: 128 if half else 168,
                    256: 0}[parse_case(case)["N"]]
        assert config.out_max_registers == want_cap
        assert plain.out_max_registers == {128: 168, 16: 128}.get(parse_case(case)["N"], want_cap)
        assert (config.out_span_chunks, config.out_num_warps) == ((1, 2) if small_chunks else
                                                                  (plain.out_span_chunks, plain.out_num_warps))


@pytest.mark.parametrize("has_z", [True, False])
def test_fused_token_weights_rule_with_the_flag_on(monkeypatch, has_z):
    """With SCAN_OUTPUTS_TOKEN_WEIGHTS on (off until the official-grid tests run with it), the fused pass takes its
    token weights wherever it runs but at N128_P64_R4_C16 without Z, where they lost (section 60)."""
    monkeypatch.setattr(production, "SCAN_OUTPUTS_TOKEN_WEIGHTS", True)
    taken = set()
    for case in OFFICIAL_CASES:
        config = choose_config(B=4, H=16, S=2048, num_sms=132, has_z=has_z, **parse_case(case))
        assert not config.scan_outputs_token_weights or config.scan_outputs
        if config.scan_outputs_token_weights:
            taken.add(case)
    fused = {"N64_P64_R4_C16", "N128_P32_R4_C16", "N128_P64_R8_C8", "N128_P64_R2_C32"}
    want = fused | {"N128_P64_R4_C16", "N64_P128_R4_C16"} if has_z else fused
    assert taken == want


@pytest.mark.parametrize("N,P,R,C,state_span", [(16, 64, 4, 8, 2), (32, 64, 4, 16, 1), (256, 64, 4, 8, 1),
                                                (128, 128, 4, 8, 1), (64, 64, 2, 8, 2)])
def test_dispatcher_state_spans(N, P, R, C, state_span):
    """The storing scan takes two chunks a step where short chunks are read in spans of SPAN_ROWS rows, at N <= 64
    only (optimization.md 18); R = 2, C = 8 spans four chunks in the end-state scan and two in the storing scan.
    (chunk_scan may take single chunks instead: SMALL_CHUNK_SCAN, N16.)"""
    config = choose_config(B=4, H=16, S=2048, N=N, P=P, R=R, chunk_size=C, num_sms=132)
    assert config.state_span_chunks == state_span
    assert state_span == 1 or config.end_span_chunks >= state_span


@pytest.fixture(params=[False, True], ids=["narrow_p", "wide_p"])
def wide_narrow_scan(request, monkeypatch):
    """The dispatcher with production.WIDE_NARROW_SCAN off (the 32-wide tile it replaced) and on (the default)."""
    monkeypatch.setattr(production, "WIDE_NARROW_SCAN", request.param)
    choose_config.cache_clear()
    yield request.param
    choose_config.cache_clear()


@pytest.mark.parametrize("half_tables", [True, False])
@pytest.mark.parametrize("N,P,R,C,has_z,segments,half_table_segments", [
    (64, 64, 4, 16, True, 3, 4), (64, 128, 4, 16, False, 3, 2), (32, 64, 4, 16, True, 4, 5), (16, 64, 4, 8, True, 4, 5),
    (128, 64, 4, 16, True, 4, 4), (128, 32, 4, 16, False, 4, 4), (128, 64, 1, 64, True, 4, 4)])
def test_dispatcher_local_state_segments_fill_one_wave(N, P, R, C, has_z, segments, half_table_segments, half_tables,
                                                       wide_narrow_scan):
    """The one-pass scan takes as many segments as leave every program resident at once (sweeps of 4b8eeb1:
    3 segments at N64, where 4 spilled into a second wave; 4 at N <= 32 and N = 128, where 5-8 lose).  With
    fp16 rotation tables the narrow tiles take a register cap that fits 4 / 5 programs an SM, and one more
    segment (sweep of f67b954); the 64-wide tiles keep theirs.  The [2 x 32, 64] tile of N64_P128 loads a step
    ahead at 2 programs an SM instead (sweeps of f57a6ee).  At N <= 32 with P = 64 the scan takes all of P in one
    tile at 4 programs an SM, which doubles the segments of one wave (sweep of a45a4ab, section 42;
    ``WIDE_NARROW_SCAN``, on since its GPU test passed in section 43)."""
    config = choose_config(B=4, H=16, S=2048, N=N, P=P, R=R, chunk_size=C, num_sms=132, has_z=has_z,
                           half_tables=half_tables, swept_knobs=False)  # the Triton scan's rule (the Gluon one above)
    prefetch = half_tables and (config.block_half, config.block_p) in PREFETCH_SCAN_RESIDENCY
    wide = wide_narrow_scan and half_tables and (config.block_half, P) in WIDE_NARROW_SCAN_RESIDENCY
    assert wide is (wide_narrow_scan and half_tables and N <= 32)  # N16 / N32 (P = 64): all of P in one tile
    if wide:
        assert config.block_p == P
        segments = 8
        per_sm, cap = WIDE_NARROW_SCAN_RESIDENCY[config.block_half, P]
    elif prefetch:
        segments = half_table_segments
        per_sm, cap = PREFETCH_SCAN_RESIDENCY[config.block_half, config.block_p], 0
    elif half_tables:
        segments = half_table_segments
        per_sm, cap = HALF_TABLE_SCAN_RESIDENCY[config.block_half]
    else:
        per_sm, cap = RESIDENT_SCAN_PROGRAMS[config.block_half], 0
    assert config.local_states and config.n_segments == segments and config.scan_max_registers == cap
    assert config.scan_prefetch is prefetch and config.num_warps == 4
    assert (N, P) != (64, 128) or prefetch is half_tables
    tiles = -(-N // 2 // config.block_half) * -(-P // config.block_p)
    resident = per_sm * 132
    assert segments * 64 * tiles <= resident < (segments + 1) * 64 * tiles
    # Every program of the wave fits in an SM's 64K registers at the cap (registers go out per warp in 256s).
    assert not cap or per_sm * 4 * 32 * cap <= 65536


@pytest.mark.parametrize("has_z", [True, False])
@pytest.mark.parametrize("N,P,C,segments,warps", [(256, 64, 8, 2, 8), (128, 128, 8, 2, 4)])
def test_dispatcher_two_pass_segments_and_warps(N, P, C, segments, warps, has_z):
    """Two-pass scans: [2 x 64, 64] tiles at 8 warps, one program an SM; narrower tiles at 2 an SM (sweeps of
    f57a6ee and 8ebfff3: N256 911 -> 829 us, N128_P128 882 -> 855); none loads ahead.  (N16 without Z took two
    passes with the fused stage until section 38.)"""
    config = choose_config(B=4, H=16, S=2048, N=N, P=P, R=4, chunk_size=C, num_sms=132, has_z=has_z)
    assert not config.local_states and not config.scan_prefetch
    assert (config.n_segments, config.num_warps) == (segments, warps)
    assert TWO_PASS_SCAN[config.block_half] == ({64: 1, 32: 2, 16: 2}[config.block_half], warps)


def test_two_pass_schedule_keeps_an_uncapped_scan():
    """The register caps belong to the one-pass schedule's wave rule: the two-pass shapes scan uncapped."""
    for N, P, C in ((256, 64, 8), (128, 128, 8)):
        config = choose_config(B=4, H=16, S=2048, N=N, P=P, R=4, chunk_size=C, num_sms=132)
        assert not config.local_states and config.scan_max_registers == 0


def test_sweep_of_gate_in_scan():
    """gate_in_scan candidates are split-stage configs without a gate_grads setting (chunk_scan applies the gate)."""
    chosen, configs = sweep_configs(**SHAPE, knob_names=["gate_in_scan", "split_gate"])
    in_scan = [c for c in configs if c.gate_in_scan]
    assert in_scan == [dataclasses.replace(chosen, gate_in_scan=True, gate_tokens=ScanConfig.gate_tokens)]
    assert all(c.split_gate for c in in_scan)
    assert not any(c.gate_in_scan for c in configs if not c.split_gate)


@pytest.mark.parametrize("R,C,has_z,in_scan", [(1, 64, True, True), (1, 64, False, True), (2, 32, True, False),
                                               (4, 16, True, False), (4, 16, False, True), (8, 8, False, True)])
def test_dispatcher_gate_in_scan(R, C, has_z, in_scan):
    """chunk_scan applies the gate itself without Z, and with Z at R = 1 only (optimization.md 19), without a
    gate_grads setting; but without Z where the fused storing scan takes the shape (SCAN_OUTPUTS_WITHOUT_Z_P)."""
    config = choose_config(B=4, H=16, S=2048, N=128, P=64, R=R, chunk_size=C, num_sms=132, has_z=has_z)
    in_scan = in_scan and not (not has_z and C <= 16 and 64 in production.SCAN_OUTPUTS_WITHOUT_Z_P)
    assert config.split_gate and config.gate_in_scan is in_scan
    assert not in_scan or config.gate_tokens == ScanConfig.gate_tokens


@pytest.mark.parametrize("case", ["N128_P64_R4_C16", "N128_P32_R4_C16", "N128_P64_R8_C8"])
def test_dispatcher_keeps_the_gate_in_chunk_scan_without_z_off_hopper(case):
    """Without Z the fused storing scan replaces chunk_scan's gate only where it runs (hopper): elsewhere its
    fallback is the split gate, which loses to chunk_scan's without Z (section 19)."""
    shape = dict(B=4, H=16, S=2048, num_sms=132, has_z=False, **parse_case(case))
    off_hopper = choose_config(**shape, hopper=False)
    assert off_hopper.gate_in_scan and not off_hopper.scan_outputs
    on_hopper = choose_config(**shape)
    fused = parse_case(case)["P"] in production.SCAN_OUTPUTS_WITHOUT_Z_P
    assert on_hopper.scan_outputs is fused and on_hopper.gate_in_scan is not fused
    # Everything else as on Hopper.
    assert dataclasses.replace(on_hopper, gate_in_scan=True, scan_outputs=False, gluon_gate=False,
                               gate_tokens=ScanConfig.gate_tokens, scan_outputs_gate=False,
                               scan_outputs_ring_weights=False, scan_outputs_weights_ahead=False,
                               scan_outputs_token_weights=False,
                               out_token_weights=production.OUT_TOKEN_WEIGHTS and parse_case(case)["R"] > 1,
                               out_early_mixing=parse_case(case)["R"] == 1) == off_hopper


def test_production_asks_the_dispatcher_whether_the_gluon_kernels_run(monkeypatch):
    """The production path passes ``hopper`` to the dispatcher from the inputs' device: False on the CPU."""
    from mamba3_mimo import api
    from mamba3_mimo.inputs import make_inputs

    asked = []

    class Asked(Exception):
        pass

    def spy(**kw):
        asked.append(kw)
        raise Asked

    monkeypatch.setattr(production, "choose_config", spy)
    inputs = make_inputs(B=1, S=32, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=torch.bfloat16, seed=0, z=False)
    with pytest.raises(Asked):
        api.bwd_fwd(**inputs, output_dtype=torch.bfloat16)
    assert asked and asked[0]["hopper"] is False and asked[0]["has_z"] is False


def test_sweep_at_one_rank_offers_gate_grads_with_its_token_range():
    """Where the dispatcher applies the gate in chunk_scan, the sweep's gate_grads candidate takes the dispatcher's
    token range for gate_grads, as the split stage would be chosen at R > 1."""
    shape = dict(B=4, S=2048, H=16, N=128, P=64, R=1, chunk_size=64, num_sms=132)
    chosen, configs = sweep_configs(**shape, knob_names=["gate_in_scan"])
    assert chosen.gate_in_scan
    split = [c for c in configs if c.split_gate and not c.gate_in_scan]
    tokens = gate_tokens_per_program(B=4, H=16, S=2048, R=1, P=64, num_sms=132)
    assert split == [dataclasses.replace(chosen, gate_in_scan=False, gate_tokens=tokens)]
    assert tokens != ScanConfig.gate_tokens


def test_sweep_takes_explicit_knob_values():
    chosen, configs = sweep_configs(**SHAPE, knob_names=["n_segments=3:6", "block_half=16+n_segments=5",
                                                         "gate_in_scan=1"])
    assert {(c.block_half, c.n_segments) for c in configs if _moved(c, chosen) <= {"block_half", "n_segments"}} == {
        (chosen.block_half, chosen.n_segments), (chosen.block_half, 3), (chosen.block_half, 6), (16, 5)}
    assert [c.gate_in_scan for c in configs if "gate_in_scan" in _moved(c, chosen)] == [True]
    with pytest.raises(ValueError, match="integer values"):
        sweep_configs(**SHAPE, knob_names=["n_segments=three"])
