"""The kernels' GPU-only branches compile for sm_90 (on the CPU: the interpreter never takes them).

Constexpr flags that ``host_utils`` sets only for CUDA tensors (the approximate or libdevice sigmoid and exp, inline
PTX) select code the interpreter tests never see; a branch that Triton's compiler rejects would surface first on a GPU.
A str default of a jit helper's constexpr did (it runs in the interpreter, not in the compiler).  This file, run
as a script in a process without the interpreter, captures every launch of small calls as
``benchmarks/aot_report.py`` does (CPU tensors taken as CUDA ones) and compiles each for sm_90 with the Triton
wheel's ptxas; the tests read what it compiled.
"""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")

# The three places of the gate's sigmoid (the kernel that applies it: the config that makes it), with fp32
# activations (the libdevice sigmoid): the fused output stage on a query tile of two ranks, chunk_scan's gate, and
# gate_grads; and stage0 in both dtypes.
CALLS = {
    "production-fp32-chunk_output": dict(block_p=16, n_segments=2, out_block_p=32, ranks_per_step=2),
    "production-fp32-chunk_scan_gate": dict(block_p=16, n_segments=2, out_block_p=32, local_states=True,
                                            split_gate=True, gate_in_scan=True),
    "production-fp32-gate_grads": dict(block_p=16, n_segments=2, out_block_p=32, split_gate=True),
    "stage0-fp32-serial_scan": None,
    "stage0-bf16-serial_scan": None,
}
# The same fp32 calls with libdevice's exp (host_utils.FP32_PRECISE_EXP, off by default; the next GPU run tries it).
PRECISE_EXP_CALLS = [call for call in CALLS if call.startswith("production-fp32")]
# bf16 calls with programmatic dependent launch (ScanConfig.pdl) that together launch every production kernel.
PDL_CALLS = {
    "local-split-flat": dict(block_p=16, n_segments=2, out_block_p=32, local_states=True, split_gate=True,
                             flat_tables=True),
    "two-pass-fused": dict(block_p=16, n_segments=2, out_block_p=32),
    "gate-in-scan-fold1": dict(block_p=16, n_segments=3, out_block_p=32, local_states=True, split_gate=True,
                               gate_in_scan=True, fold_one_scan=True),
}
PDL_KERNELS = {"token_tables", "flat_token_tables", "state_scan", "segment_entry", "segment_entry_scan", "chunk_scan",
               "chunk_scan_gate", "gate_grads", "chunk_output", "group_sum"}
# A bf16 call whose chunks have 256 (token, rank) rows (C = 64, R = 4) at N = 256: before the inner chunks its
# chunk_scan took 288 KB of shared memory (docs/optimization.md section 41).  Its scan and output stage compiled for
# a 99 KB GPU (sm_89) and for Hopper.
LARGE_CHUNK_CALL = dict(B=1, S=256, H=2, G=1, N=256, P=64, R=4, chunk_size=64)
LARGE_CHUNK_ARCHS = (89, 90)
# chunk_scan's token weights (ScanConfig.out_token_weights, docs/optimization.md section 59) on official shapes where
# chunk_scan runs, with Z (raw_y stored) and without (the gate in chunk_scan): the dispatcher's config with the knob
# off and on.
TOKEN_WEIGHTS_CASES = (("N32_P64_R4_C16", True), ("N32_P64_R4_C16", False), ("N128_P128_R4_C8", False),
                       ("N256_P64_R4_C8", True))
# SASS of griddepcontrol.wait / .launch_dependents, and of the accesses to global memory.
GRID_WAIT, GRID_TRIGGER = "ACQBULK", "PREEXIT"
GLOBAL_ACCESS = ("LDG", "STG", "UTMALDG", "UTMASTG", "UBLKCP", "RED", "ATOMG")


# The kernels that start work before their wait (section 40), and their parameters pointing to what the launch just
# before them writes.
WRITTEN_BY_PREDECESSOR = {"chunk_scan": ("states_ptr", "seg_entry_ptr", "entry_decay_ptr"),
                          "chunk_scan_gate": ("states_ptr", "seg_entry_ptr", "entry_decay_ptr"),
                          "segment_entry": ("seg_state_ptr",),
                          "segment_entry_scan": ("seg_state_ptr",),
                          "gate_grads": ("raw_y_ptr", "raw_y_scale_ptr"),
                          "gluon_gate": ("y_desc", "raw_y_scale_ptr")}
PTX_ACCESS = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")


def accesses_through(kernel, pointers):
    """(accesses before griddepcontrol.wait, accesses in all) to global memory in the kernel's PTX whose address (or
    TMA descriptor) is computed from one of the ``pointers`` parameters: a forward pass over the PTX, in order, that
    marks every register defined from a marked one."""
    names = [name for name, kind in kernel.src.signature.items() if kind != "constexpr"]
    ptx = kernel.asm["ptx"]
    marked = set()
    for name in pointers:
        param = f"{kernel.name}_param_{names.index(name)}"
        # a pointer is loaded from its parameter; a TMA descriptor is addressed as the parameter itself
        marked |= set(re.findall(r"ld\.param\.\w+\s+(%\w+), \[" + param + r"\]", ptx))
        marked |= set(re.findall(r"mov\.\w+\s+(%\w+), " + param + ";", ptx))
    early = total = 0
    waited = False
    for line in ptx.split("\n"):
        waited = waited or "griddepcontrol.wait" in line
        registers = re.findall(r"%\w+", line)
        if PTX_ACCESS.search(line):
            if marked.intersection(re.findall(r"\[\s*(%\w+)", line)):
                total += 1
                early += not waited
        elif registers and any(r in marked for r in registers[1:]):
            marked.add(registers[0])
    return early, total


def dependent_launch_summary(kernel, name=None):
    """What the test checks of a kernel compiled for programmatic dependent launch: its launch flag, how many
    waits and triggers it has, whether a wait comes before its first access to global memory, and for the kernels
    that work before the wait, how many of their accesses to what the launch before them writes come first."""
    import sass_report

    ops = [opcode for _, opcode, _ in sass_report.sass_ops(kernel)]
    first_access = next(i for i, opcode in enumerate(ops) if opcode.startswith(GLOBAL_ACCESS))
    summary = dict(launch_pdl=kernel.metadata.launch_pdl, waits=ops.count(GRID_WAIT),
                   triggers=ops.count(GRID_TRIGGER), waits_first=GRID_WAIT in ops[:first_access])
    if name in WRITTEN_BY_PREDECESSOR:
        summary["early_accesses"], summary["accesses"] = accesses_through(kernel, WRITTEN_BY_PREDECESSOR[name])
    return summary


def compile_pdl_calls():
    """{call: {kernel: summary}} for PDL_CALLS (Triton kernels) and the two Gluon kernels; CUDA taken as sm_90."""
    import aot_report
    import gluon_gate_grads_check
    import gluon_scan_probe

    from mamba3_mimo import api
    from mamba3_mimo.ops.production import ScanConfig

    aot_report.compile_as_cuda()
    compiled = {}
    for call, knobs in PDL_CALLS.items():
        inputs = aot_report.empty_inputs(B=1, S=64, H=2, G=1, N=64, P=32, R=2, chunk_size=16, dtype=torch.bfloat16)
        config = ScanConfig(**knobs, pdl=True)
        launches = aot_report.capture_launches(
            lambda: api.bwd_fwd(**inputs, output_dtype=torch.bfloat16, config=config))
        compiled[call] = {}
        for name, args, kwargs in launches:  # the two-pass scans launch one kernel twice: "state_scan", "state_scan#2"
            key = name if name not in compiled[call] else f"{name}#{len(compiled[call])}"
            compiled[call][key] = dependent_launch_summary(aot_report.compile_launch(name, args, kwargs), name)
    compiled["gluon"] = {f"gluon_scan-{role}": dependent_launch_summary(
        gluon_scan_probe.compile_for_sm90("N128_P64_R4_C16", role=role, gdc=True)) for role in gluon_scan_probe.ROLES}
    gate_case, gate_config = gluon_gate_grads_check.gate_cases()[0]  # the first official shape that runs gate_grads
    compiled["gluon"]["gluon_gate"] = dependent_launch_summary(
        gluon_gate_grads_check.compile_for_sm90(gate_case, gate_config, gdc=True)["kernel"], "gluon_gate")
    return compiled


def compile_calls():
    """{call: {"kernels": names compiled, "sigmoid": the flags fp32 activations get}}; raises on a compile error."""
    sys.path.insert(0, BENCHMARKS)
    import aot_report

    from mamba3_mimo import api
    from mamba3_mimo.ops import host_utils
    from mamba3_mimo.ops.production import ScanConfig

    aot_report.compile_as_cuda()
    compiled = {}
    for precise_exp, calls in ((False, list(CALLS)), (True, PRECISE_EXP_CALLS)):
        host_utils.FP32_PRECISE_EXP = precise_exp
        for call in calls:
            impl, dtype_name, _ = call.split("-")
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
            config = ScanConfig(**CALLS[call]) if CALLS[call] else None
            inputs = aot_report.empty_inputs(B=1, S=64, H=2, G=1, N=64, P=32, R=2, chunk_size=16, dtype=dtype)
            launches = aot_report.capture_launches(
                lambda: api.bwd_fwd(**inputs, output_dtype=dtype, impl=impl, config=config))
            for name, args, kwargs in launches:
                aot_report.compile_launch(name, args, kwargs)
            compiled[call + ("-precise_exp" if precise_exp else "")] = dict(
                kernels=sorted({name for name, _, _ in launches}), sigmoid=host_utils.sigmoid_units(inputs["q"]),
                precise_exp=[kwargs.get("PRECISE_EXP", False) for _, _, kwargs in launches])
    return compiled


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("call", list(CALLS) + [call + "-precise_exp" for call in PRECISE_EXP_CALLS])
def test_call_compiles_for_sm90(compiled, call):
    impl, dtype_name, kernel = call.split("-")[:3]
    assert kernel in compiled[call]["kernels"]
    if impl == "production":
        assert compiled[call]["sigmoid"] == dict(FAST_SIGMOID=False, PRECISE_SIGMOID=True)
        # The exp knob reaches the kernels that take it only where it is asked for.
        assert any(compiled[call]["precise_exp"]) == call.endswith("-precise_exp")


@pytest.mark.parametrize("call", list(PDL_CALLS) + ["gluon"])
def test_dependent_launches_wait_before_their_first_load(compiled, call):
    """With ``ScanConfig.pdl`` a kernel may start while the previous one runs: every kernel of these calls is
    launched with the flag and waits (griddepcontrol.wait) before any access to global memory, then triggers the next
    once.  The warp-specialized Gluon scan waits in both partitions: its producer warp issues TMA loads itself."""
    kernels = compiled["pdl"][call]
    for name, summary in kernels.items():
        partitions = 2 if name.startswith("gluon_scan") else 1
        if name.split("#")[0] in WRITTEN_BY_PREDECESSOR:
            # These ask for the call's inputs (and tables written further back) before the wait: chunk_scan its
            # rotation tables, the segment fold its decay table,
            # gate_grads its dout / z / v; what the launch just before writes (states and segment entries, seg_state,
            # raw_y) only after it.
            assert summary["accesses"] > 0 and summary["early_accesses"] == 0, name
            summary = {key: summary[key] for key in ("launch_pdl", "waits", "triggers")}
            assert summary == dict(launch_pdl=True, waits=1, triggers=1), name
            continue
        assert summary == dict(launch_pdl=True, waits=partitions, triggers=partitions, waits_first=True), name
    names = {name.split("#")[0] for name in kernels}
    if call != "gluon":
        assert names <= PDL_KERNELS
    assert {name.split("#")[0] for c in PDL_CALLS for name in compiled["pdl"][c]} == PDL_KERNELS


def compile_large_chunks():
    """{arch: {kernel: shared bytes}} of LARGE_CHUNK_CALL's state scan and chunk_scan launches."""
    import aot_report
    from triton.backends.compiler import GPUTarget

    from mamba3_mimo import api

    aot_report.compile_as_cuda()
    inputs = aot_report.empty_inputs(dtype=torch.bfloat16, **LARGE_CHUNK_CALL)
    launches = aot_report.capture_launches(lambda: api.bwd_fwd(**inputs, output_dtype=torch.bfloat16))
    shared = {}
    for arch in LARGE_CHUNK_ARCHS:
        aot_report.TARGET = GPUTarget("cuda", arch, 32)
        shared[arch] = {name: aot_report.compile_launch(name, args, kwargs).metadata.shared
                        for name, args, kwargs in launches if name in ("state_scan", "chunk_scan")}
    return shared


def compile_token_weights():
    """{case-z: {"off" / "on": {"SASS", "MUFU", "HGMMA", "BAR", "shared": shared-memory accesses, "stack"}}} of
    chunk_scan's launch in TOKEN_WEIGHTS_CASES with ``out_token_weights`` off and on."""
    import collections

    import aot_report
    import sass_report

    aot_report.compile_as_cuda()
    counts = {}
    for case, z in TOKEN_WEIGHTS_CASES:
        forms = counts[f"{case}-{'z' if z else 'noz'}"] = {}
        for form, flag in (("off", 0), ("on", 1)):
            launches = aot_report.official_launches(case, f"out_token_weights={flag}", z=z)
            (name, args, kwargs), = [launch for launch in launches if launch[0].startswith("chunk_scan")]
            assert kwargs.get("TOKEN_WEIGHTS", False) is bool(flag), (case, form)
            kernel = aot_report.compile_launch(name, args, kwargs)
            ops = collections.Counter(opcode.split(".")[0] for _, opcode, _ in sass_report.sass_ops(kernel))
            forms[form] = dict(SASS=sum(ops.values()), MUFU=ops["MUFU"], HGMMA=ops["HGMMA"], BAR=ops["BAR"],
                               shared=sum(ops[op] for op in ("LDS", "STS", "LDSM", "STSM")),
                               stack=aot_report.resources(kernel)["stack"])
    return counts


def test_chunk_scan_token_weights_take_fewer_instructions(compiled):
    """chunk_scan weighing the scores viewed as [rows, tokens, ranks] compiles to fewer instructions than a weight a
    score, with the same tensor-core ops, barriers and shared-memory accesses (the view relabels registers), and at
    most 8 B more spill a thread."""
    counts = compiled["token_weights"]
    assert len(counts) == len(TOKEN_WEIGHTS_CASES)
    for case, forms in counts.items():
        off, on = forms["off"], forms["on"]
        assert on["SASS"] < off["SASS"], (case, forms)
        assert {key: on[key] for key in ("HGMMA", "BAR", "shared")} == {key: off[key] for key in
                                                                       ("HGMMA", "BAR", "shared")}, (case, forms)
        assert on["stack"] <= off["stack"] + 8, (case, forms)


def test_large_chunks_fit_99kb(compiled):
    """Chunks over 64 rows are walked as inner chunks (production.inner_chunk_size), so their launches keep to the
    99 KB bound like the official grid's."""
    from mamba3_mimo.ops.gluon_state_scan import SMEM_LIMIT

    for arch in LARGE_CHUNK_ARCHS:
        shared = compiled["large_chunks"][str(arch)]
        assert set(shared) == {"state_scan", "chunk_scan"}, arch
        assert max(shared.values()) <= SMEM_LIMIT, (arch, shared)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    print(json.dumps(dict(compile_calls(), pdl=compile_pdl_calls(), large_chunks=compile_large_chunks(),
                          token_weights=compile_token_weights())))
