"""The Gluon state scan (mamba3_mimo/ops/gluon_state_scan.py) and the production path's ``gluon_scan`` knob.

Gluon kernels do not run in the Triton interpreter, so on the CPU the kernel is compiled for sm_90 (ptxas and
cuobjdump ship with the triton wheel) and its structure is checked (a warp-specialized register split, the
update as wgmma, no global loads in the consumer's chunk loop, shared memory within the 99 KB bound), its programs
are replayed in torch against the production scans (benchmarks/gluon_scan_probe.py), and the knob is shown inert
where the kernel does not apply.  Its values are checked on a Hopper GPU only.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_knob_inert, assert_next_call_replays, spy_on_replays

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import gluon_scan_probe  # noqa: E402

from mamba3_mimo import api  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.ops import gluon_state_scan  # noqa: E402
from mamba3_mimo.ops.production import choose_config  # noqa: E402

# The interpreter's loads in chunk_local_states take offsets through numpy's deprecated array-to-int conversion.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The probe's --compile-only records on the six shapes.  In a process of its own: Gluon's library cannot be
    imported as compiled code into a session that runs the interpreter (the CPU tests)."""
    out = tmp_path_factory.mktemp("gluon") / "compiled.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gluon_scan_probe.py")
    run = subprocess.run([sys.executable, script, "--compile-only", "--json", str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {(record["case"], record["role"]): record for record in json.loads(out.read_text())}


@pytest.mark.parametrize("role", list(gluon_state_scan.ROLES))
@pytest.mark.parametrize("case", gluon_scan_probe.GLUON_CASES)
def test_probe_compiles_warp_specialized_within_99_kb(compiled, case, role):
    found = compiled[case, role]
    shape = gluon_scan_probe.parse_case(case)
    assert found["num_buffers"] == gluon_state_scan.ring_depth(C=shape["chunk_size"], R=shape["R"],
                                                               block_p=found["block_p"], N=shape["N"],
                                                               store_states=gluon_state_scan.ROLES[role][0])
    # The producer warp gives its registers back (24 idle, 40 working) and the consumer warpgroup takes them.
    assert gluon_state_scan.PRODUCER_REGISTERS.value in found["setmaxnreg"]
    assert max(found["setmaxnreg"]) > 128, found
    # The update runs as wgmma; the consumer's chunk loop reads from global memory only the next chunk's few per-token
    # weights (its tiles arrive by TMA).
    assert found["HGMMA"] >= 4 and found["LDG"] <= shape["chunk_size"] + 1, found
    # Where the weights ride the ring (``ring_weights``), the loop loads nothing from global memory.
    if gluon_state_scan.ring_weights(C=shape["chunk_size"], N=shape["N"], P=shape["P"], block_p=found["block_p"]):
        assert found["LDG"] == 0, found
    assert found["shared"] <= gluon_state_scan.SMEM_LIMIT, found
    assert 0 <= found["shared"] - found["shared_model"] <= 768, found


def test_ring_depth_takes_the_deepest_ring_that_fits():
    # N128_P64_R4_C16: 2 stages of 22.7 KB fit beside the 44 KB of operands, 3 do not.
    assert gluon_state_scan.ring_depth(C=16, R=4, block_p=64) == 2
    assert gluon_state_scan.ring_depth(C=64, R=1, block_p=64) == 1
    assert gluon_state_scan.ring_depth(C=8, R=4, block_p=64) == 3
    # N = 64 holds half the bytes a stage and in the operands: N64_P64_R4_C16 takes 3 (63.5 KB).
    assert gluon_state_scan.ring_depth(C=16, R=4, block_p=64, N=64) == 3
    assert gluon_state_scan.shared_bytes(C=16, R=4, block_p=64, num_buffers=3, N=64, ring_weights=False) == 63_488
    # The weight rows of a ring of 3 (RING_WEIGHTS): 4 slots of da_rev, trap_scale (16 fp32 each) and the decay.
    assert gluon_state_scan.shared_bytes(C=16, R=4, block_p=64, num_buffers=3, N=64, ring_weights=True) == (
        63_488 + 4 * (2 * 16 + 1) * 4)


@pytest.mark.parametrize("case, in_ring", [
    ("N64_P64_R4_C16", True), ("N128_P64_R4_C16", True), ("N128_P64_R8_C8", True), ("N256_P64_R4_C8", True),
    ("N128_P32_R4_C16", True), ("N64_P128_R4_C16", True),
    ("N128_P128_R4_C8", False), ("N128_P64_R2_C32", False), ("N128_P64_R1_C64", False)])
def test_ring_weights_where_the_h100_timed_a_gain(case, in_ring, monkeypatch):
    """Section 49's A/B per official shape: the weights ride the ring with chunks of at most 16 rows, except over
    two P tiles at N = 128; ``RING_WEIGHTS = False`` turns them off everywhere."""
    shape = gluon_scan_probe.parse_case(case)
    block_p = choose_config(B=4, H=16, S=2048, num_sms=132, **shape).block_p
    tile = dict(C=shape["chunk_size"], N=shape["N"], P=shape["P"], block_p=block_p)
    assert gluon_state_scan.ring_weights(**tile) is in_ring
    monkeypatch.setattr(gluon_state_scan, "RING_WEIGHTS", False)
    assert gluon_state_scan.ring_weights(**tile) is False


@pytest.mark.parametrize("case, store_buffers", [("N64_P64_R4_C16", 2), ("N64_P128_R4_C16", 2), ("N256_P64_R4_C8", 2),
                                                 ("N128_P64_R1_C64", 2), ("N128_P64_R4_C16", 1), ("N128_P32_R4_C16", 1),
                                                 ("N128_P64_R2_C32", 1)])
def test_state_store_buffers_take_what_fits_beside_the_ring(case, store_buffers):
    """Two state-store buffers where they fit beside the ring within 99 KB (N = 64: 63.5 + 8 KB), else one; the ring
    keeps its depth, and a role that stores no states takes one.  The default allows one (MAX_STATE_STORE_BUFFERS)."""
    shape = gluon_scan_probe.parse_case(case)
    tile = dict(C=shape["chunk_size"], R=shape["R"], block_p=min(shape["P"], 64), N=shape["N"])
    depth = gluon_state_scan.ring_depth(**tile)
    assert gluon_state_scan.state_store_buffers(**tile, num_buffers=depth, most=2) == store_buffers
    assert gluon_state_scan.state_store_buffers(**tile, num_buffers=depth, most=2, store_states=False) == 1
    assert gluon_state_scan.state_store_buffers(**tile, num_buffers=depth) == min(
        store_buffers, gluon_state_scan.MAX_STATE_STORE_BUFFERS)
    limit = gluon_state_scan.SMEM_LIMIT - 768
    assert gluon_state_scan.shared_bytes(**tile, num_buffers=depth, store_buffers=store_buffers) <= limit
    if store_buffers == 1:
        assert gluon_state_scan.shared_bytes(**tile, num_buffers=depth, store_buffers=2) > limit


@pytest.mark.parametrize("case, operand_buffers", [("N64_P64_R4_C16", 2), ("N64_P128_R4_C16", 2),
                                                    ("N256_P64_R4_C8", 2), ("N128_P128_R4_C8", 2),
                                                    ("N128_P64_R4_C16", 1), ("N128_P32_R4_C16", 1),
                                                    ("N128_P64_R8_C8", 1), ("N128_P64_R2_C32", 1),
                                                    ("N128_P64_R1_C64", 1)])
def test_update_operand_buffers_take_what_fits_beside_the_ring(case, operand_buffers):
    """Two sets of update operands where they fit beside a ring of at least two stages (kept at its depth) within
    99 KB, in every role; the state-store buffers then take what is left.  The default allows one
    (MAX_OPERAND_BUFFERS)."""
    shape = gluon_scan_probe.parse_case(case)
    tile = dict(C=shape["chunk_size"], R=shape["R"], block_p=min(shape["P"], 64), N=shape["N"])
    limit = gluon_state_scan.SMEM_LIMIT - 768
    for store_states in (True, False):
        depth = gluon_state_scan.ring_depth(**tile, store_states=store_states)
        chosen = gluon_state_scan.update_operand_buffers(**tile, num_buffers=depth, store_states=store_states, most=2)
        assert chosen == (operand_buffers if store_states else max(chosen, operand_buffers))
        assert gluon_state_scan.update_operand_buffers(**tile, num_buffers=depth, store_states=store_states) == min(
            chosen, gluon_state_scan.MAX_OPERAND_BUFFERS)
        stores = gluon_state_scan.state_store_buffers(**tile, num_buffers=depth, store_states=store_states, most=2,
                                                      operand_buffers=chosen)
        assert gluon_state_scan.shared_bytes(**tile, num_buffers=depth, store_states=store_states,
                                             operand_buffers=chosen, store_buffers=stores) <= limit
        if chosen == 1 and depth >= 2:
            assert gluon_state_scan.shared_bytes(**tile, num_buffers=depth, store_states=store_states,
                                                 operand_buffers=2) > limit
    # Two operand sets hold twice the operands' bytes: N64_P64_R4_C16's 16 KB.
    assert gluon_state_scan.shared_bytes(C=16, R=4, block_p=64, num_buffers=3, N=64, operand_buffers=2,
                                         ring_weights=False) == 79_872


@pytest.mark.parametrize("change, message", [
    (dict(N=96), "N = 64 or a multiple of 128"),
    (dict(N=32), "N = 64 or a multiple of 128"),
    (dict(P=96), "P tile"),
    (dict(P=128, block_p=128), "P tile"),
    (dict(R=3), "power of two"),
    (dict(S=2040), "multiple of C"),
    (dict(chunk_size=64), "one ring stage within 101376 bytes"),  # 256 rows: 64 KB of k alone a stage
    (dict(dtypes=(torch.float32, torch.float32, torch.float32)), "bf16 k and states"),
])
def test_probe_refuses_shapes_its_boxes_do_not_cover(change, message):
    problem = dict(B=1, S=2048, R=4, G=1, N=128, H=16, P=64, RD=32, chunk_size=16, block_p=64,
                   dtypes=(torch.bfloat16, torch.float16, torch.bfloat16))
    problem.update(change)
    with pytest.raises(ValueError, match=message):
        gluon_state_scan.check_shape(**problem)


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("N, num_buffers, half_rotation", [(64, 1, False), (64, None, False), (128, 1, False),
                                                            (128, 2, False), (256, None, False), (64, None, True),
                                                            (128, 2, True), (256, None, True)])
def test_probe_matches_the_production_scans_and_the_golden(N, num_buffers, half_rotation):
    # Outputs start as NaN: an element the probe leaves unwritten reads as an infinite error.  half_rotation: k's bias
    # add and rotation in bf16 in both the kernel and the production scans it is compared with.
    errors = gluon_scan_probe.check_small(N=N, num_buffers=num_buffers, half_rotation=half_rotation)
    assert set(errors) == {"local", "end", "store", "golden_local", "golden_store"}
    assert max(errors.values()) <= 1e-2, errors


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("case", gluon_scan_probe.GLUON_CASES)
def test_probe_matches_the_production_scans_on_official_shapes(case):
    errors = gluon_scan_probe.check_case(case)
    assert {"local", "end", "store"} <= set(errors) and max(errors.values()) <= 1e-2, errors


@pytest.mark.skipif(torch.cuda.is_available(), reason="the production scans run on CPU tensors in the interpreter here")
@pytest.mark.parametrize("N", [64, 128, 256])
def test_emulated_programs_match_the_production_scans_and_the_golden(N):
    # The kernel's boxes, fold and index arithmetic in each role, replayed in torch from its own descriptors (Gluon
    # cannot run here); the production scans run in the interpreter.
    errors = gluon_scan_probe.check_emulation(N)
    assert set(errors) == {"local", "end", "store", "golden_local", "golden_store"}
    assert max(errors.values()) <= 1e-2, errors


def _spy_on_gluon_wrappers(monkeypatch):
    """Count the calls of the Gluon scan's wrappers (and let them run)."""
    calls = []
    for name in ("gluon_chunk_local_states", "gluon_segment_end_states", "gluon_chunk_states"):
        wrapped = getattr(gluon_state_scan, name)

        def spy(*args, _wrapped=wrapped, _name=name, **kwargs):
            calls.append(_name)
            return _wrapped(*args, **kwargs)

        monkeypatch.setattr(gluon_state_scan, name, spy)
    return calls


def test_unsupported_names_the_reason(device):
    import triton.language as tl

    inputs = make_inputs(B=1, S=64, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=torch.bfloat16, device=device)
    scan = gluon_scan_probe.scan_arguments(inputs, n_segments=2, block_half=64, block_p=64, num_warps=4,
                                           dot_dtype=tl.bfloat16, dot_precision="ieee")
    states = torch.empty((1, 2, 4, 128, 64), device=device, dtype=torch.bfloat16)
    reason = gluon_state_scan.unsupported(**scan, states=states)
    if not HOPPER:
        assert reason is not None and "Hopper" in reason
        return
    assert reason is None
    misaligned = torch.empty(inputs["v"].numel() + 1, device=device, dtype=torch.bfloat16)[1:].view(inputs["v"].shape)
    assert "v contiguous and 16-byte aligned" in gluon_state_scan.unsupported(**dict(scan, v=misaligned),
                                                                              states=states)
    assert "bf16 k and states" in gluon_state_scan.unsupported(**scan, states=states.float())
    assert "multiple of C" in gluon_state_scan.unsupported(**dict(scan, chunk_size=24), states=states)


def test_gluon_scan_knob_is_inert_where_the_kernel_does_not_apply(device, monkeypatch):
    """Off Hopper (here: the interpreter) and on shapes its boxes do not cover, ``gluon_scan`` runs the Triton scans:
    the same launches, the same outputs bit for bit, no Gluon call."""
    calls = _spy_on_gluon_wrappers(monkeypatch)
    # N = 32 is outside the kernel's boxes, so a Hopper GPU falls back as well.
    inputs = make_inputs(B=1, S=48, H=2, G=1, N=32, P=32, R=2, chunk_size=16, dtype=torch.bfloat16, seed=3,
                         device=device)
    base = choose_config(B=1, H=2, S=48, N=32, P=32, R=2, chunk_size=16, num_sms=4)
    assert_knob_inert(inputs, base, "gluon_scan")
    assert calls == []


def test_gluon_segments_is_inert_where_the_kernel_does_not_apply(device, monkeypatch):
    """``gluon_segments`` (the Gluon two-pass scan's segment count) leaves the Triton scans at ``n_segments``: off
    Hopper and on shapes the kernel does not cover, one Gluon segment against three gives the same outputs bit for
    bit, and no Gluon call."""
    from mamba3_mimo.ops import production

    calls = _spy_on_gluon_wrappers(monkeypatch)
    # The segment count each Triton scan launch was given (after the plan check's run of the wrappers, too).
    segments = []
    for name in ("segment_end_states", "chunk_states"):
        wrapped = getattr(production, name)
        monkeypatch.setattr(production, name, lambda *a, _wrapped=wrapped, **kw: (segments.append(kw["n_segments"]),
                                                                                  _wrapped(*a, **kw))[1])
    monkeypatch.setenv("MAMBA3_MIMO_JIT_LAUNCH", "1")  # every call through the wrappers (no whole-call replay)
    inputs = make_inputs(B=1, S=128, H=2, G=1, N=32, P=32, R=2, chunk_size=8, dtype=torch.bfloat16, seed=5,
                         device=device)
    base = dataclasses.replace(choose_config(B=1, H=2, S=128, N=32, P=32, R=2, chunk_size=8, num_sms=4),
                               local_states=False, n_segments=3, gluon_scan=True)
    # fp32 outputs: in bf16 the Triton scans at one segment and at two round to the same bits.
    assert_knob_inert(inputs, base, "gluon_segments", values=(0, 1), output_dtype=torch.float32)
    assert calls == []
    assert segments and min(segments) > 1  # three asked for; whole spans of chunks make it two here


# Official-grid-like shapes the kernel covers, at test size: local states over two P tiles and two head groups at
# N = 128 and at N = 64 (the halves stacked); N = 64 at R = 2 in two passes; N = 128 in two passes over two P tiles
# and two head groups; N = 256 (two N/2 tiles) in two passes at C = 8.
GLUON_PRODUCTION_CASES = [
    dict(N=128, P=128, R=4, chunk_size=16, S=256, H=4, G=2, local_states=True),
    dict(N=64, P=128, R=4, chunk_size=16, S=256, H=4, G=2, local_states=True),
    dict(N=64, P=64, R=2, chunk_size=16, S=192, H=2, G=1, local_states=False),
    dict(N=128, P=128, R=4, chunk_size=16, S=256, H=4, G=2, local_states=False),
    dict(N=256, P=64, R=4, chunk_size=8, S=128, H=2, G=1, local_states=False),
    # k rotated in bf16 (the local-state shapes' rule, section 47) at N = 128 and at N = 64.
    dict(N=128, P=128, R=4, chunk_size=16, S=256, H=4, G=2, local_states=True, half_rotation=True),
    dict(N=64, P=64, R=4, chunk_size=16, S=256, H=4, G=2, local_states=True, half_rotation=True),
    # 7 chunks in 3 segments: 3, 3 and 1 steps (a segment of one chunk: the two-operand-set loop's prologue alone).
    dict(N=64, P=64, R=4, chunk_size=16, S=112, H=2, G=1, local_states=True),
]


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("case", GLUON_PRODUCTION_CASES, ids=lambda c: f"N{c['N']}-P{c['P']}-S{c['S']}-"
                         f"{'local' if c['local_states'] else 'two'}{'-half' if c.get('half_rotation') else ''}")
def test_production_with_gluon_scan_matches_the_reference(check_kernel, monkeypatch, case):
    calls = _spy_on_gluon_wrappers(monkeypatch)
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H")}
    config = dataclasses.replace(choose_config(B=2, num_sms=132, **shape), n_segments=3, gluon_scan=True,
                                 local_states=case["local_states"], block_p=64,
                                 scan_half_rotation=case.get("half_rotation", False))
    check_kernel("production", B=2, G=case["G"], dtype=torch.bfloat16, output_dtype=torch.bfloat16, config=config,
                 dA_scale=0.1, **shape)
    assert calls, "the Gluon scan did not run"


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("case", [case for case in GLUON_PRODUCTION_CASES if not case["local_states"]],
                         ids=lambda c: f"N{c['N']}-P{c['P']}")
def test_gluon_two_pass_scan_in_one_segment(check_kernel, monkeypatch, case):
    """``gluon_segments = 1`` on the two-pass shapes: no end-state launch, one storing launch over every chunk,
    where ``n_segments`` (3) would take two launches."""
    # Every call through the wrappers: the reference test above may have recorded this very call for replay.
    monkeypatch.setenv("MAMBA3_MIMO_JIT_LAUNCH", "1")
    calls = _spy_on_gluon_wrappers(monkeypatch)
    launched = []
    scan_launch = gluon_state_scan._launch
    monkeypatch.setattr(gluon_state_scan, "_launch",
                        lambda **kw: (launched.append((kw["role"], kw["segments_launched"])), scan_launch(**kw)))
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H")}
    config = dataclasses.replace(choose_config(B=2, num_sms=132, **shape), n_segments=3, gluon_scan=True,
                                 local_states=False, block_p=64, gluon_segments=1)
    check_kernel("production", B=2, G=case["G"], dtype=torch.bfloat16, output_dtype=torch.bfloat16, config=config,
                 dA_scale=0.1, **shape)
    assert "gluon_chunk_states" in calls
    assert launched and set(launched) == {("store", 1)}  # every call (the plan check runs the wrappers too)


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("case", [GLUON_PRODUCTION_CASES[0], GLUON_PRODUCTION_CASES[3]], ids=["local", "two"])
@pytest.mark.parametrize("angles", [False, True], ids=["tables", "angles"])
def test_production_call_with_gluon_scan_replays(monkeypatch, poison_outputs, case, angles):
    """The second call of a signature replays the whole call, the Gluon launches with their descriptors rebuilt
    around the new tensors (no host wrapper runs), into NaN-poisoned outputs; bitwise equal to the same call
    through Triton's JIT.  ``angles``: with ``angles_in_kernels`` (the angles' boxes are the call's input)."""
    replays = spy_on_replays(monkeypatch)  # the first call below records
    calls = _spy_on_gluon_wrappers(monkeypatch)
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H")}
    config = dataclasses.replace(choose_config(B=2, num_sms=132, **shape), n_segments=3, gluon_scan=True,
                                 local_states=case["local_states"], block_p=64, angles_in_kernels=angles)

    def call(seed):
        inputs = make_inputs(B=2, G=case["G"], dtype=torch.bfloat16, device="cuda", seed=seed, **shape)
        return inputs, api.bwd_fwd(**inputs, output_dtype=torch.bfloat16, config=config)

    call(1)
    assert calls, "the Gluon scan did not run"
    assert_next_call_replays(monkeypatch, call, replays, seed=2, config=config, output_dtype=torch.bfloat16,
                             calls=calls)


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("case", GLUON_PRODUCTION_CASES, ids=lambda c: f"N{c['N']}-P{c['P']}-S{c['S']}-"
                         f"{'local' if c['local_states'] else 'two'}{'-half' if c.get('half_rotation') else ''}")
def test_gluon_scan_from_angles_computes_the_tables_values(check_kernel, monkeypatch, case):
    """``angles_in_kernels``: the Gluon scan takes the fp32 angles' boxes and chunk_scan the angles, ``token_tables``
    writes no cos / sin table, and the call meets the accuracy contract.  With the rotation in fp32 every output is
    bit for bit the call with the tables (the tables' 16-bit values, computed with the same instructions).  In bf16
    the rotation's products may pair into FMAs differently once cos / sin come from registers rather than memory:
    on the H100, N128_P128 local with the bf16 rotation moved one qk_dot element by one bf16 ulp, so there the
    contract is the check."""
    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")  # every call runs its wrappers
    from mamba3_mimo.ops import production

    launched, tables = [], []
    scan_launch = gluon_state_scan._launch
    monkeypatch.setattr(gluon_state_scan, "_launch", lambda **kw: (
        launched.append(kw.get("angles") is not None and kw["cos_angles"] is None), scan_launch(**kw))[1])
    token_tables = production.token_tables
    monkeypatch.setattr(production, "token_tables", lambda **kw: (
        tables.append(kw.get("cos_sin", True)), token_tables(**kw))[1])
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H")}
    half = case.get("half_rotation", False)
    base = dataclasses.replace(choose_config(B=2, num_sms=132, **shape), n_segments=3, gluon_scan=True,
                               local_states=case["local_states"], block_p=64, split_gate=True,
                               scan_half_rotation=half, out_half_rotation=half)
    if not half:
        inputs = make_inputs(B=2, G=case["G"], dtype=torch.bfloat16, device="cuda", seed=23, **shape)
        assert_knob_inert(inputs, base, "angles_in_kernels")
        assert tables == [True, False]
        half_way = len(launched) // 2
        assert launched and set(launched[:half_way]) == {False} and set(launched[half_way:]) == {True}
        launched.clear()
        tables.clear()
    check_kernel("production", B=2, G=case["G"], dtype=torch.bfloat16, output_dtype=torch.bfloat16,
                 config=dataclasses.replace(base, angles_in_kernels=True), dA_scale=0.1, **shape)
    assert launched and set(launched) == {True} and set(tables) == {False}
