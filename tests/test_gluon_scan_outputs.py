"""The fused storing scan (mamba3_mimo/ops/gluon_scan_outputs.py) and the production path's ``scan_outputs`` knob.

Gluon kernels do not run in the Triton interpreter: on the CPU the kernel is compiled for sm_90 and its resources
checked (warp-specialized, no spill, shared memory within the 99 KB bound and its model), its coverage rules are
unit-tested and the knob is shown inert where the kernel does not apply; its values are checked on a Hopper GPU
against the float64 reference (the accuracy contract) and against the call without it.
"""

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_knob_inert, assert_next_call_replays, spy_gate_grads, spy_on_replays

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import gluon_scan_outputs_probe  # noqa: E402

from mamba3_mimo import api  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.ops import gluon_scan_outputs, gluon_state_scan  # noqa: E402
from mamba3_mimo.ops.production import choose_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
PROBE = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gluon_scan_outputs_probe.py")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The probe's records (each covered official shape, fp32 and bf16 rotation), compiled in a process of its own:
    Gluon's compiled library cannot be imported into a session that runs the interpreter."""
    out = tmp_path_factory.mktemp("fused") / "compiled.json"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, PROBE, "--json", str(out)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


def test_compiles_warp_specialized_without_spill_within_99_kb(compiled):
    assert {record["case"] for record in compiled} == set(gluon_scan_outputs_probe.CASES)
    for record in compiled:
        shape = gluon_scan_outputs_probe.parse_case(record["case"])
        C, R = shape["chunk_size"], shape["R"]
        form = gluon_scan_outputs.GateForm(**record["gate"]) if record["gate"] else None
        layout = gluon_scan_outputs.plan(C=C, R=R, P=shape["P"], half_rotation=record["half_rotation"],
                                         block_p=record["block_p"], ring_weights=record["ring_weights"],
                                         gate_form=form, N=shape["N"], d_skip=record["d_skip"])
        assert layout._asdict() == {name: record[name] for name in layout._fields}, record
        # q rotated in place at N = 128 over 64-wide tiles; at N = 64 (half the boxes) q~ keeps its operand.
        assert layout.q_in_place == (layout.block_p == 64 and shape["N"] == 128)
        model = gluon_scan_outputs.shared_bytes(C=C, R=R, half_rotation=record["half_rotation"],
                                                ring_weights=record["ring_weights"], gate_form=form, N=shape["N"],
                                                d_skip=record["d_skip"], **layout._asdict())
        assert record["shared"] <= gluon_state_scan.SMEM_LIMIT, record
        # The model counts every buffer; the compiler adds barriers and alignment.
        assert model <= record["shared"] <= model + 768, (model, record)
        # 32-wide: no spill, but at C = 32 (32-row rank tiles of q and k to rotate): 128 B in fp32, 8 B in bf16.
        # 64-wide (twice the state, q~ @ state and raw_y columns at the same 232 registers): 80-192 B; 128-wide at
        # N = 64 (one [64, 128] state): 128 B.  The gate in the pass adds the chunk's dout / z / v rows and the gate's
        # math beside the state: none at 32 wide, 144-520 B at 64 (R2_C32 with Z the most).  The D skip in raw_y adds
        # v's rows: 112-200 B (N64_P128's 128-wide tile the most).
        if record["d_skip"]:
            assert record["stack"] <= 256, record
        elif record["gate"]:
            assert record["stack"] <= (520 if layout.block_p == 64 else 0), record
        else:
            assert record["stack"] <= (192 if layout.block_p >= 64 else 0 if C <= 16 else 128), record
        assert gluon_state_scan.PRODUCER_REGISTERS.value in record["setmaxnreg"], record
        # Seven products a chunk at N = 128, four at N = 64 (K = 64 over both halves), each of four wgmma
        # instructions (K = 16 each).
        assert record["HGMMA"] == (28 if shape["N"] == 128 else 16), record


def test_ring_weights_take_the_consumers_weight_loads(compiled):
    """With the weights through the ring (the dispatcher's tile and rotation) the kernel has fewer global loads than
    the same kernel without (da_rev and trap_scale come from shared memory) and the producer's cp.async copies."""
    ring = [record for record in compiled
            if record["ring_weights"] and not (record["weights_ahead"] or record["token_weights"])]
    assert {record["case"] for record in ring} == set(gluon_scan_outputs_probe.CASES)
    for record in ring:
        plain = [other for other in compiled if not (other["ring_weights"] or other["gate"] or other["d_skip"]
                                                     or other["weights_ahead"] or other["token_weights"]) and all(
            other[name] == record[name] for name in ("case", "block_p", "half_rotation"))]
        assert len(plain) == 1, record
        assert record["kernel_LDG"] < plain[0]["kernel_LDG"], (record, plain[0])
        assert record["kernel_LDGSTS"] > 0 == plain[0]["kernel_LDGSTS"], (record, plain[0])


def test_token_weights_take_fewer_instructions(compiled):
    """The intra-chunk weights once a (row, column token): fewer exps and instructions than the same form's with a
    weight a score, as many wgmma and no more spill (the scores viewed as [rows, R, C] relabel registers: no layout
    conversion through shared memory, so no more barriers either)."""
    fields = ("case", "block_p", "half_rotation", "ring_weights", "gate", "d_skip", "weights_ahead")
    pairs = 0
    for record in (record for record in compiled if record["token_weights"]):
        same = [other for other in compiled if not other["token_weights"]
                and all(other[name] == record[name] for name in fields)]
        if not same:
            continue
        pairs += 1
        other, = same
        assert record["kernel_MUFU"] < other["kernel_MUFU"], (record, other)
        assert record["kernel_SASS"] < other["kernel_SASS"], (record, other)
        assert record["HGMMA"] == other["HGMMA"] and record["BAR"] <= other["BAR"], (record, other)
        assert record["stack"] <= other["stack"], (record, other)
    assert pairs >= 8, pairs


@pytest.mark.parametrize("change, message", [
    (dict(N=256), "N in (64, 128)"),
    (dict(P=48), "a P tile of 32 or 64 dividing P"),
    (dict(R=4, chunk_size=8), "C * R = 64"),
    (dict(S=200), "S a multiple of C"),
    (dict(dtypes=(torch.float16,) * 4 + (torch.float16,)), "bf16 q, k, v and states"),
    (dict(dtypes=(torch.bfloat16,) * 4 + (torch.float32,)), "16-bit tables"),
])
def test_shape_problems_name_the_reason(change, message):
    problem = dict(S=256, R=4, N=128, P=64, chunk_size=16, dtypes=(torch.bfloat16,) * 4 + (torch.float16,))
    assert gluon_scan_outputs.shape_problems(**problem) == []
    problems = gluon_scan_outputs.shape_problems(**dict(problem, **change))
    assert len(problems) == 1 and message in problems[0], problems


def test_plan_takes_the_widest_p_tile_that_fits():
    bf16 = dict(half_rotation=True)
    assert gluon_scan_outputs.plan(C=16, R=4, P=64, **bf16) == (64, 1, True, True)
    assert gluon_scan_outputs.plan(C=16, R=4, P=128, **bf16).block_p == 64
    assert gluon_scan_outputs.plan(C=16, R=4, P=32, **bf16) == (32, 1, False, False)
    assert gluon_scan_outputs.plan(C=16, R=4, P=64, block_p=32, **bf16) == (32, 1, False, False)
    # fp32 bias rows or 32-token chunks leave no room for the weighed scores' buffer: they go over q~.
    assert gluon_scan_outputs.plan(C=16, R=4, P=64) == (64, 1, True, False)
    assert gluon_scan_outputs.plan(C=32, R=2, P=64, **bf16) == (64, 1, True, False)
    assert gluon_scan_outputs.plan(C=16, R=4, P=96, block_p=64) is None
    # The gate's head tiles take the weighed scores' buffer's room but where Phi is the only one (no Z, no D).
    for has_z, has_d in itertools.product((False, True), repeat=2):
        gate = gluon_scan_outputs.GateForm(has_z, has_d)
        weighed = not (has_z or has_d)
        assert gluon_scan_outputs.plan(C=16, R=4, P=64, gate_form=gate, **bf16) == (64, 1, True, weighed)
        assert gluon_scan_outputs.plan(C=8, R=8, P=64, gate_form=gate, **bf16) == (64, 1, True, False)
    # N = 64: half the boxes and operands, so q~ keeps its operand, two ring stages, and without the gate a 128-wide
    # tile (the gate's dz scratch over k~'s operands holds a 64-wide one).
    assert gluon_scan_outputs.plan(C=16, R=4, P=64, N=64, **bf16) == (64, 2, False, False)
    assert gluon_scan_outputs.plan(C=16, R=4, P=128, N=64, **bf16) == (128, 1, False, False)
    gate = gluon_scan_outputs.GateForm(True, True)
    assert gluon_scan_outputs.plan(C=16, R=4, P=128, N=64, gate_form=gate, **bf16) == (64, 2, False, False)
    for C, R in ((16, 4), (8, 8), (32, 2)):
        for half_rotation in (False, True):
            layout = gluon_scan_outputs.plan(C=C, R=R, P=64, half_rotation=half_rotation)
            shared = gluon_scan_outputs.shared_bytes(C=C, R=R, half_rotation=half_rotation, **layout._asdict())
            assert shared + 768 <= gluon_state_scan.SMEM_LIMIT


def test_one_chunk_of_64_rows_fits_one_stage_at_most():
    # R1_C64's stage (64 tokens of angles and v) passes the bound: refused, not launched over it.
    assert gluon_scan_outputs.shape_problems(S=256, R=1, N=128, P=64, chunk_size=64,
                                             dtypes=(torch.bfloat16,) * 4 + (torch.float16,))
    for C, R in ((16, 4), (8, 8), (32, 2)):
        assert gluon_scan_outputs.shared_bytes(C=C, R=R) + 768 <= gluon_state_scan.SMEM_LIMIT


def _config(case, **knobs):
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H")}
    return dataclasses.replace(choose_config(B=2, num_sms=132, **shape), gluon_scan=True, split_gate=True,
                               gate_in_scan=False, **knobs)


def test_scan_outputs_knob_is_inert_where_the_kernel_does_not_apply(device):
    """Off Hopper (the CPU interpreter here) the knob routes nothing: bitwise the call without it."""
    if HOPPER:
        pytest.skip("the kernel applies here; its values are checked by the GPU tests below")
    case = dict(N=128, P=32, R=2, chunk_size=32, S=64, H=2)
    inputs = make_inputs(B=2, G=1, N=128, P=32, R=2, chunk_size=32, S=64, H=2, dtype=torch.bfloat16, device=device,
                         seed=5)
    assert_knob_inert(inputs, _config(case, angles_in_kernels=True), "scan_outputs")


FUSED_CASES = [
    # The dispatcher's form at N128_P64_R4_C16 (angles, bf16 rotation: 64-wide, q in place, the weighed scores'
    # buffer) and over two 32-wide tiles, the tables with fp32 rotation (64-wide, the weighed scores over q~), C = 32
    # at P = 32 and at P = 64, C = 8 at R = 8, P = 128 over two 64-wide tiles; with and without Z.
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True),
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, block_p=32),
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=False, half=False, z=True),
    dict(N=128, P=32, R=2, chunk_size=32, S=256, H=2, G=1, angles=True, half=True, z=True),
    dict(N=128, P=64, R=2, chunk_size=32, S=256, H=2, G=1, angles=True, half=True, z=True),
    dict(N=128, P=64, R=8, chunk_size=8, S=128, H=2, G=1, angles=True, half=True, z=True),
    dict(N=128, P=128, R=4, chunk_size=16, S=128, H=2, G=1, angles=True, half=True, z=True),
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=False),
    # The per-token weights through the ring (scan_outputs_ring_weights): the dispatcher's form, 8-token chunks
    # (the producer's 32 lanes copy each weight four times over), 32-token chunks over a 32-wide tile with tables.
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, ring=True),
    dict(N=128, P=64, R=8, chunk_size=8, S=128, H=2, G=1, angles=True, half=True, z=False, ring=True),
    dict(N=128, P=32, R=2, chunk_size=32, S=256, H=2, G=1, angles=False, half=False, z=True, ring=True),
    # The gate in the pass (scan_outputs_gate): the dispatcher's form with and without Z, without D, 8-token chunks
    # (two ranks a warp), 32-token chunks (a rank over two warps), a 32-wide tile with the tables, P = 128 over two
    # 64-wide tiles.
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, gate=True),
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=False, gate=True),
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, gate=True, d=False),
    dict(N=128, P=64, R=8, chunk_size=8, S=128, H=2, G=1, angles=True, half=True, z=True, gate=True),
    dict(N=128, P=64, R=2, chunk_size=32, S=256, H=2, G=1, angles=True, half=True, z=True, gate=True),
    dict(N=128, P=32, R=4, chunk_size=16, S=256, H=2, G=1, angles=False, half=False, z=True, gate=True),
    dict(N=128, P=128, R=4, chunk_size=16, S=128, H=2, G=1, angles=True, half=True, z=True, gate=True),
    # N = 64 (both halves stacked in one 64-row state and one operand each): the dispatcher's form at P = 64, P = 128
    # over one 128-wide tile, a 32-wide tile with the tables, 8-token chunks, the ring weights, the gate with and
    # without Z.
    dict(N=64, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True),
    dict(N=64, P=128, R=4, chunk_size=16, S=256, H=2, G=1, angles=True, half=True, z=True),
    dict(N=64, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=False, half=False, z=True, block_p=32),
    dict(N=64, P=64, R=8, chunk_size=8, S=128, H=2, G=1, angles=True, half=True, z=False),
    dict(N=64, P=128, R=4, chunk_size=16, S=256, H=2, G=1, angles=True, half=True, z=True, ring=True),
    dict(N=64, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, gate=True),
    dict(N=64, P=128, R=4, chunk_size=16, S=256, H=2, G=1, angles=True, half=True, z=False, gate=True, ring=True),
    # The D skip added to the stored raw_y (scan_outputs_d_skip): over a 128-wide tile at N = 64, q rotated in place
    # at N = 128, a 32-wide tile with the tables.
    dict(N=64, P=128, R=4, chunk_size=16, S=256, H=2, G=1, angles=True, half=True, z=True, d_skip=True),
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, d_skip=True),
    dict(N=128, P=32, R=2, chunk_size=32, S=256, H=2, G=1, angles=False, half=False, z=False, d_skip=True),
    # The end-state pass over spans of two chunks (end_span_chunks, on span_decays' tables): the dispatcher's forms at
    # N128_P64_R4_C16 and N64_P128, 8-token chunks at R = 8 with the ring weights and the gate without Z, 64-token
    # spans over a 32-wide tile with the tables.
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, ring=True, end_span=2),
    dict(N=64, P=128, R=4, chunk_size=16, S=256, H=2, G=1, angles=True, half=True, z=True, end_span=2),
    dict(N=128, P=64, R=8, chunk_size=8, S=128, H=2, G=1, angles=True, half=True, z=False, ring=True, gate=True,
         end_span=2),
    dict(N=128, P=32, R=2, chunk_size=32, S=256, H=2, G=1, angles=False, half=False, z=True, end_span=2),
    # The log decays a step ahead (scan_outputs_weights_ahead): the dispatcher's forms (the ring weights, with Z, and
    # the gate without Z, over 64- and 32-wide tiles), and with the consumer's own da_rev / trap_scale loads (also a
    # step ahead) at N = 64 and at 8-token chunks with the gate.
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, ring=True, ahead=True),
    dict(N=128, P=32, R=4, chunk_size=16, S=256, H=2, G=1, angles=True, half=True, z=False, ring=True, gate=True,
         ahead=True),
    dict(N=64, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, ahead=True),
    dict(N=128, P=64, R=8, chunk_size=8, S=128, H=2, G=1, angles=False, half=False, z=False, gate=True, ahead=True),
    # The intra-chunk weights once a (row, column token) (scan_outputs_token_weights): the dispatcher's forms at N = 128
    # (16-token chunks with the ring and the step-ahead decays, 8 and 32 tokens with the gate), at N = 64 over 64- and
    # 128-wide tiles, and a 32-wide tile with the tables.
    dict(N=128, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=True, ring=True, ahead=True,
         token=True),
    dict(N=128, P=64, R=8, chunk_size=8, S=128, H=2, G=1, angles=True, half=True, z=False, gate=True, token=True),
    dict(N=128, P=64, R=2, chunk_size=32, S=256, H=2, G=1, angles=True, half=True, z=True, ring=True, token=True),
    dict(N=64, P=64, R=4, chunk_size=16, S=256, H=4, G=2, angles=True, half=True, z=False, gate=True, token=True),
    dict(N=64, P=128, R=4, chunk_size=16, S=256, H=2, G=1, angles=True, half=True, z=True, token=True),
    dict(N=128, P=32, R=4, chunk_size=16, S=256, H=2, G=1, angles=False, half=False, z=True, token=True),
]


def _spy(monkeypatch):
    from mamba3_mimo.ops import production

    calls, tiles = [], []
    fused = gluon_scan_outputs.scan_outputs
    monkeypatch.setattr(gluon_scan_outputs, "scan_outputs",
                        lambda **kw: (calls.append(kw["n_segments"]), tiles.append(kw["block_p"]), fused(**kw))[2])
    chunk_scan = production.chunk_scan
    monkeypatch.setattr(production, "chunk_scan", lambda **kw: (calls.append("chunk_scan"), chunk_scan(**kw))[1])
    return calls, tiles


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"{'N64-' if c['N'] == 64 else ''}"
                         f"R{c['R']}-C{c['chunk_size']}-P{c['P']}"
                         f"{'-angles' if c['angles'] else ''}{'-half' if c['half'] else ''}{'-z' if c['z'] else ''}"
                         f"{'-tile%d' % c['block_p'] if 'block_p' in c else ''}{'-ring' if c.get('ring') else ''}"
                         f"{'-gate' if c.get('gate') else ''}{'-nod' if c.get('d') is False else ''}"
                         f"{'-dskip' if c.get('d_skip') else ''}{'-span%d' % c['end_span'] if 'end_span' in c else ''}"
                         f"{'-ahead' if c.get('ahead') else ''}{'-token' if c.get('token') else ''}")
def test_production_with_scan_outputs_matches_the_reference(check_kernel, monkeypatch, case):
    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")  # every call runs its wrappers
    calls, tiles = _spy(monkeypatch)
    end_chunks = []
    end_pass = gluon_state_scan.gluon_segment_end_states
    monkeypatch.setattr(gluon_state_scan, "gluon_segment_end_states",
                        lambda **kw: (end_chunks.append(kw["chunk_size"]), end_pass(**kw))[1])
    config = _config(case, scan_outputs=True, angles_in_kernels=case["angles"], scan_half_rotation=case["half"],
                     out_half_rotation=case["half"], scan_outputs_block_p=case.get("block_p", 0), gluon_segments=0,
                     scan_outputs_ring_weights=case.get("ring", False), scan_outputs_gate=case.get("gate", False),
                     scan_outputs_d_skip=case.get("d_skip", False), end_span_chunks=case.get("end_span", 1),
                     scan_outputs_weights_ahead=case.get("ahead", False),
                     scan_outputs_token_weights=case.get("token", False))
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H", "G")}
    gates = spy_gate_grads(monkeypatch)
    check_kernel("production", B=2, dtype=torch.bfloat16, output_dtype=torch.bfloat16, config=config, dA_scale=0.1,
                 z=case["z"], d=case.get("d", True), **shape)
    assert calls and "chunk_scan" not in calls, calls
    # With the gate in the pass neither gate_grads kernel runs.
    assert (gates == []) is case.get("gate", False), gates
    # With the D skip in the pass gate_grads adds none.
    if case.get("d_skip"):
        assert not any(with_d for _, with_d in gates), gates
    # Several segments: the storing pass folds the end-state pass's states, from chunks of end_span_chunks chunks.
    assert min(calls) > 1, calls
    assert set(end_chunks) == {case.get("end_span", 1) * case["chunk_size"]}, end_chunks
    form = gluon_scan_outputs.GateForm(case["z"], case.get("d", True)) if case.get("gate") else None
    widest = gluon_scan_outputs.plan(C=case["chunk_size"], R=case["R"], P=case["P"], N=case["N"],
                                     half_rotation=case["half"], ring_weights=case.get("ring", False), gate_form=form,
                                     d_skip=case.get("d_skip", False))
    assert set(tiles) == {case.get("block_p", widest.block_p)}, tiles


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("end_span", [1, 2], ids=["chunks", "spans"])
def test_scan_outputs_call_replays(monkeypatch, poison_outputs, end_span):
    """The second call of a signature replays the whole call (no host wrapper runs) into NaN-poisoned outputs,
    bitwise the same call through Triton's JIT.  With the end pass over spans the span tables are scratch of their
    own size: freed before the call ends, their block could be handed to other scratch and the call would not
    replay (the eager regression of section 56)."""
    replays = spy_on_replays(monkeypatch)
    calls, _ = _spy(monkeypatch)
    end_chunks = []
    end_pass = gluon_state_scan.gluon_segment_end_states
    monkeypatch.setattr(gluon_state_scan, "gluon_segment_end_states",
                        lambda **kw: (end_chunks.append(kw["chunk_size"]), end_pass(**kw))[1])
    case = FUSED_CASES[0]
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H", "G")}
    config = _config(case, scan_outputs=True, angles_in_kernels=True, scan_half_rotation=True,
                     out_half_rotation=True, gluon_segments=0, end_span_chunks=end_span)

    def call(seed):
        inputs = make_inputs(B=2, dtype=torch.bfloat16, device="cuda", seed=seed, dA_scale=0.1, **shape)
        return inputs, api.bwd_fwd(**inputs, output_dtype=torch.bfloat16, config=config)

    call(1)
    assert calls and "chunk_scan" not in calls, calls
    assert set(end_chunks) == {end_span * case["chunk_size"]}, end_chunks
    assert_next_call_replays(monkeypatch, call, replays, seed=2, config=config, output_dtype=torch.bfloat16,
                             calls=calls)


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
def test_scan_outputs_agree_with_chunk_scan(monkeypatch):
    """Against the same call through chunk_scan (two passes, the same segments): the states within one bf16 unit
    (the same update; the bf16 rotation's products may pair into FMAs differently), raw_y's consumers and qk_dot
    within 2^-6 of their largest (rows in another order, q~ rotated in the scan's form); a misplaced row or column
    moves them by far more."""
    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")
    calls, _ = _spy(monkeypatch)
    case = FUSED_CASES[0]
    shape = {name: case[name] for name in ("N", "P", "R", "chunk_size", "S", "H", "G")}
    inputs = make_inputs(B=2, dtype=torch.bfloat16, device="cuda", seed=11, dA_scale=0.1, **shape)
    fused = api.bwd_fwd(**inputs, output_dtype=torch.bfloat16,
                        config=_config(case, scan_outputs=True, angles_in_kernels=True))
    segments = calls[0]
    plain = api.bwd_fwd(**inputs, output_dtype=torch.bfloat16,
                        config=_config(case, angles_in_kernels=True, local_states=False, n_segments=segments,
                                       gluon_segments=segments))
    assert calls[-1] == "chunk_scan"
    # (states, qk_dot, dmimo_o, dmimo_z, dz)
    torch.testing.assert_close(fused[0].float(), plain[0].float(), rtol=2 ** -7, atol=2 ** -20)
    for name, got, want in zip(("qk_dot", "dmimo_o", "dmimo_z", "dz"), fused[1:], plain[1:]):
        scale = want.float().abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= 2 ** -6 * scale, name


@pytest.mark.parametrize("ring_weights, weights_ahead, token_weights",
                         [(False, False, False), (True, False, False), (True, True, False), (False, False, True)],
                         ids=["own-loads", "ring-weights", "ring-weights-ahead", "token-weights"])
def test_host_wrapper_launches_with_q_and_k_boxes(monkeypatch, ring_weights, weights_ahead, token_weights):
    """The wrapper's launch on the CPU, the kernel replaced by a recorder: one program per (P tile, segment, (b, h)),
    q's and k's descriptors over their own tensors with the same rank-major [R, C, 64] boxes, the angles' box, and
    the fold's end states (or a stand-in with one segment); RING_WEIGHTS, WEIGHTS_AHEAD and TOKEN_WEIGHTS only where
    asked for (the default launch keeps the GPU-tested specialization's arguments)."""
    launched = []
    monkeypatch.setattr(gluon_scan_outputs, "launch", lambda kernel, grid, *args, **constants: launched.append(
        (grid, args, constants)))
    inputs = make_inputs(B=1, S=64, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=torch.bfloat16, seed=3)
    B, S, H, P, R, N, C = 1, 64, 2, 64, 4, 128, 16
    weights = torch.rand(2, B, H, S)
    outputs = dict(states=torch.empty(B, H, S // C, N, P, dtype=torch.bfloat16),
                   qk_dot=torch.empty(B, H, S, R, R, dtype=torch.bfloat16),
                   raw_y=torch.empty(B, H, S, R, P, dtype=torch.float16),
                   raw_y_scale=torch.empty(B, H, S, R, 1))
    seg_state = torch.empty(B, H, 2, N, P)
    gluon_scan_outputs.scan_outputs(
        q=inputs["q"], k=inputs["k"], v=inputs["v"], q_bias=inputs["q_bias"], k_bias=inputs["k_bias"],
        mimo_v=inputs["mimo_v"], da_cs=inputs["da_cs"], da_cs_rev=inputs["da_cs_rev"], gamma=weights[0],
        trap_scale=weights[1], seg_state=seg_state, chunk_size=C, n_segments=2, chunks_per_segment=2,
        angles=inputs["angles"], table_dtype=torch.float16, ring_weights=ring_weights, weights_ahead=weights_ahead,
        token_weights=token_weights, **outputs)
    (grid, args, constants), = launched
    assert constants.get("RING_WEIGHTS", False) is ring_weights and ("RING_WEIGHTS" in constants) is ring_weights
    assert ("WEIGHTS_AHEAD" in constants) is weights_ahead and constants.get("WEIGHTS_AHEAD", False) is weights_ahead
    assert ("TOKEN_WEIGHTS" in constants) is token_weights and constants.get("TOKEN_WEIGHTS", False) is token_weights
    # P = 64 in one 64-wide tile (fp32 bias rows: q rotated in place, the weighed scores over q~).
    assert grid == (1, 2, B * H)
    assert constants["BLOCK_P"] == 64 and constants["Q_IN_PLACE"] and not constants["WEIGHED_BUFFER"]
    q_desc, k_desc, angle_desc = args[:3]
    assert q_desc.base is inputs["q"] and k_desc.base is inputs["k"] and angle_desc.base is inputs["angles"]
    assert list(q_desc.block_shape) == list(k_desc.block_shape) == [R, C, N // 2]
    assert list(q_desc.shape) == list(k_desc.shape) == [R, B * S, N]
    assert args[13] is seg_state and args[14] is outputs["raw_y"] and args[15] is outputs["raw_y_scale"]
    assert constants["SCALED_RAW_Y"] and constants["NUM_BUFFERS"] == 1
    assert list(args[4].block_shape) == [C, 64] and list(args[5].block_shape) == [64, 64]  # v and states boxes


@pytest.mark.parametrize("z, d", [(True, True), (False, True), (True, False)], ids=["z-d", "d", "z"])
def test_host_wrapper_launches_the_gate_in_the_pass(monkeypatch, z, d):
    """With ``gate`` the wrapper launches GATE (HAS_Z / HAS_D as given) with no raw_y scratch: raw_y's three pointers
    stand in as qk_dot, the gate's inputs and outputs follow in the kernel's order (absent ones standing in as dout),
    and the plan leaves room for the gate's head tiles."""
    launched = []
    monkeypatch.setattr(gluon_scan_outputs, "launch", lambda kernel, grid, *args, **constants: launched.append(
        (grid, args, constants)))
    inputs = make_inputs(B=1, S=64, H=2, G=1, N=128, P=64, R=4, chunk_size=16, dtype=torch.bfloat16, seed=3, z=z,
                         d=d)
    B, S, H, P, R, N, C = 1, 64, 2, 64, 4, 128, 16
    weights = torch.rand(2, B, H, S)
    qk_dot = torch.empty(B, H, S, R, R, dtype=torch.bfloat16)
    dphi = torch.empty(B, H, 2, R, P)
    gate = dict(dout=inputs["dout"], z=inputs["z"], mimo_o=inputs["mimo_o"], mimo_z=inputs["mimo_z"], d=inputs["d"],
                dz=torch.empty(B, S, H, P, dtype=torch.bfloat16) if z else None, dphi=dphi,
                dzeta=torch.empty_like(dphi) if z else None)
    scan = dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], q_bias=inputs["q_bias"], k_bias=inputs["k_bias"],
                mimo_v=inputs["mimo_v"], da_cs=inputs["da_cs"], da_cs_rev=inputs["da_cs_rev"], gamma=weights[0],
                trap_scale=weights[1], seg_state=torch.empty(B, H, 2, N, P), chunk_size=C, n_segments=2,
                chunks_per_segment=2, angles=inputs["angles"], table_dtype=torch.bfloat16, half_rotation=True,
                states=torch.empty(B, H, S // C, N, P, dtype=torch.bfloat16), qk_dot=qk_dot)
    gluon_scan_outputs.scan_outputs(**scan, raw_y=None, raw_y_scale=None, gate=gate)
    (grid, args, constants), = launched
    assert constants["GATE"] and constants["HAS_Z"] is z and constants["HAS_D"] is d
    assert grid == (1, 2, B * H) and constants["BLOCK_P"] == 64
    # Phi's head tile with Zeta's or D Psi's leaves no room for the weighed scores' buffer beside bf16 bias rows.
    assert constants["Q_IN_PLACE"] and not constants["WEIGHED_BUFFER"]
    assert args[14] is qk_dot and args[15] is qk_dot and args[16] is qk_dot
    stand_in = inputs["dout"]
    want = [inputs["dout"], inputs["z"], inputs["v"], inputs["mimo_o"], inputs["mimo_z"], inputs["d"], gate["dz"],
            dphi, gate["dzeta"]]
    for got, expected in zip(args[17:26], want):
        assert got is (stand_in if expected is None else expected)
    assert args[26:29] == (S, H, 1)
    # raw_y and the gate do not go together; the partials must cover every segment.
    with pytest.raises(ValueError, match="no raw_y scratch"):
        gluon_scan_outputs.scan_outputs(**scan, raw_y=torch.empty(B, H, S, R, P), raw_y_scale=None, gate=gate)
    with pytest.raises(ValueError, match="dphi needs"):
        gluon_scan_outputs.scan_outputs(**scan, raw_y=None, raw_y_scale=None,
                                        gate=dict(gate, dphi=torch.empty(B, H, 1, R, P)))


@pytest.mark.parametrize("N, P, block_p", [(128, 64, 64), (64, 128, 128)], ids=["N128-P64", "N64-P128"])
def test_host_wrapper_launches_the_d_skip_into_raw_y(monkeypatch, N, P, block_p):
    """With ``d`` and no gate the wrapper launches HAS_D without GATE: raw_y and its scales as without it, v and d in
    the kernel's v_ptr and d_ptr, the other gate pointers standing in as qk_dot; ``d`` beside the gate is refused."""
    launched = []
    monkeypatch.setattr(gluon_scan_outputs, "launch", lambda kernel, grid, *args, **constants: launched.append(
        (grid, args, constants)))
    B, S, H, R, C = 1, 64, 2, 4, 16
    inputs = make_inputs(B=B, S=S, H=H, G=1, N=N, P=P, R=R, chunk_size=C, dtype=torch.bfloat16, seed=3, d=True)
    weights = torch.rand(2, B, H, S)
    qk_dot = torch.empty(B, H, S, R, R, dtype=torch.bfloat16)
    raw_y = torch.empty(B, H, S, R, P, dtype=torch.float16)
    raw_y_scale = torch.empty(B, H, S, R, P // block_p)
    scan = dict(q=inputs["q"], k=inputs["k"], v=inputs["v"], q_bias=inputs["q_bias"], k_bias=inputs["k_bias"],
                mimo_v=inputs["mimo_v"], da_cs=inputs["da_cs"], da_cs_rev=inputs["da_cs_rev"], gamma=weights[0],
                trap_scale=weights[1], seg_state=torch.empty(B, H, 2, N, P), chunk_size=C, n_segments=2,
                chunks_per_segment=2, angles=inputs["angles"], table_dtype=torch.bfloat16, half_rotation=True,
                states=torch.empty(B, H, S // C, N, P, dtype=torch.bfloat16), qk_dot=qk_dot)
    gluon_scan_outputs.scan_outputs(**scan, raw_y=raw_y, raw_y_scale=raw_y_scale, d=inputs["d"])
    (grid, args, constants), = launched
    assert constants["HAS_D"] and "GATE" not in constants and constants["BLOCK_P"] == block_p
    assert grid == (P // block_p, 2, B * H)
    assert args[14] is raw_y and args[15] is raw_y_scale and args[16] is qk_dot
    want = [qk_dot, qk_dot, inputs["v"], qk_dot, qk_dot, inputs["d"], qk_dot, qk_dot, qk_dot]
    for got, expected in zip(args[17:26], want):
        assert got is expected
    # Without d the launch is the plain one: no HAS_D, every gate pointer standing in as qk_dot.
    launched.clear()
    gluon_scan_outputs.scan_outputs(**scan, raw_y=raw_y, raw_y_scale=raw_y_scale)
    (_, args, constants), = launched
    assert "HAS_D" not in constants and all(arg is qk_dot for arg in args[16:26])
    gate = dict(dout=inputs["dout"], z=None, mimo_o=inputs["mimo_o"], mimo_z=None, d=inputs["d"], dz=None,
                dphi=torch.empty(B, H, 2, R, P), dzeta=None)
    with pytest.raises(ValueError, match="the gate's d"):
        gluon_scan_outputs.scan_outputs(**scan, raw_y=None, raw_y_scale=None, gate=gate, d=inputs["d"])
