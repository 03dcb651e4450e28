"""The Gluon scan probe (benchmarks/gluon_scan_probe.py).

Gluon kernels do not run in the Triton interpreter, so on the CPU the probe is compiled for sm_90 (ptxas and
cuobjdump ship with the triton wheel) and its structure is checked: a warp-specialized register split, the
update as wgmma, no global loads in the consumer's chunk loop, shared memory within the 99 KB bound.  Its values
are checked on a Hopper GPU only, against chunk_local_states and the float64 reference.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import gluon_scan_probe  # noqa: E402

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


@pytest.mark.parametrize("role", list(gluon_scan_probe.ROLES))
@pytest.mark.parametrize("case", gluon_scan_probe.GLUON_CASES)
def test_probe_compiles_warp_specialized_within_99_kb(compiled, case, role):
    found = compiled[case, role]
    shape = gluon_scan_probe.parse_case(case)
    assert found["num_buffers"] == gluon_scan_probe.ring_depth(C=shape["chunk_size"], R=shape["R"], N=shape["N"],
                                                               block_p=found["block_p"],
                                                               store_states=gluon_scan_probe.ROLES[role][0])
    # The producer warp gives its registers back (24 idle, 40 working) and the consumer warpgroup takes them.
    assert gluon_scan_probe.PRODUCER_REGISTERS.value in found["setmaxnreg"]
    assert max(found["setmaxnreg"]) > 128, found
    # The update runs as wgmma, and the consumer's chunk loop reads nothing from global memory.
    assert found["HGMMA"] >= 4 and found["LDG"] == 0, found
    assert found["shared"] <= gluon_scan_probe.SMEM_LIMIT, found
    assert 0 <= found["shared"] - found["shared_model"] <= 768, found


def test_ring_depth_takes_the_deepest_ring_that_fits():
    # N128_P64_R4_C16: 2 stages of 22.7 KB fit beside the 44 KB of operands, 3 do not.
    assert gluon_scan_probe.ring_depth(C=16, R=4, N=128, block_p=64) == 2
    assert gluon_scan_probe.ring_depth(C=64, R=1, N=128, block_p=64) == 1
    assert gluon_scan_probe.ring_depth(C=8, R=4, N=128, block_p=64) == 3


@pytest.mark.parametrize("change, message", [
    (dict(N=64), "multiple of 128"),
    (dict(P=96), "P tile"),
    (dict(P=128, block_p=128), "P tile"),
    (dict(R=3), "power of two"),
    (dict(S=2040), "multiple of C"),
    (dict(dtypes=(torch.float32, torch.float32, torch.float32)), "bf16 activations"),
])
def test_probe_refuses_shapes_its_boxes_do_not_cover(change, message):
    problem = dict(B=1, S=2048, R=4, G=1, N=128, H=16, P=64, RD=32, chunk_size=16, block_p=64,
                   dtypes=(torch.bfloat16, torch.float16, torch.bfloat16))
    problem.update(change)
    with pytest.raises(ValueError, match=message):
        gluon_scan_probe.check_shape(**problem)


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("N, num_buffers", [(128, 1), (128, 2), (256, None)])
def test_probe_matches_the_production_scans_and_the_golden(N, num_buffers):
    # Outputs start as NaN: an element the probe leaves unwritten reads as an infinite error.
    errors = gluon_scan_probe.check_small(N=N, num_buffers=num_buffers)
    assert set(errors) == {"local", "end", "store", "golden_local", "golden_store"}
    assert max(errors.values()) <= 1e-2, errors


@pytest.mark.skipif(not HOPPER, reason="Gluon's wgmma / TMA kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("case", gluon_scan_probe.GLUON_CASES)
def test_probe_matches_the_production_scans_on_official_shapes(case):
    errors = gluon_scan_probe.check_case(case)
    assert {"local", "end", "store"} <= set(errors) and max(errors.values()) <= 1e-2, errors


@pytest.mark.parametrize("N", [128, 256])
def test_emulated_programs_match_the_production_scans_and_the_golden(N):
    # The kernel's boxes, fold and index arithmetic in each role, replayed in torch from its own descriptors (Gluon
    # cannot run here); the production scans run in the interpreter.
    errors = gluon_scan_probe.check_emulation(N)
    assert set(errors) == {"local", "end", "store", "golden_local", "golden_store"}
    assert max(errors.values()) <= 1e-2, errors
