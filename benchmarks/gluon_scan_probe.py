"""Checks and timings of the Gluon state scan (``mamba3_mimo/ops/gluon_state_scan.py``) without and with a GPU.

    python benchmarks/gluon_scan_probe.py --compile-only   # no GPU: each role compiled for sm_90 (resources,
                                                           # register split, the consumer's chunk loop in SASS)
    python benchmarks/gluon_scan_probe.py                  # Hopper GPU: values against the production scans and
                                                           # the float64 reference, then every role timed

Gluon kernels do not run in the Triton interpreter, so on the CPU the kernel is compiled for sm_90 and its programs
are replayed in torch (``emulate``: the boxes its producer asks for, from its own host descriptors and coordinates,
and its consumer's fold, rotation, weights and update), which checks the descriptors and the index arithmetic
against the production scans running in the interpreter.  The Gluon code itself is checked on a Hopper GPU
(``check_small``, ``check_case``; ``tests/test_gluon_state_scan.py``).  docs/optimization.md section 33.
"""

import argparse
import collections
import itertools
import json
import os
import re
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tma_scan_probe import max_relative_error, scan_arguments  # noqa: E402

from mamba3_mimo.bench import parse_case  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.ops.chunk_state import chunk_local_states  # noqa: E402
from mamba3_mimo.ops.gluon_state_scan import (  # noqa: E402
    MAX_REGISTERS,
    ROLES,
    STATE_ROWS,
    _gluon_scan_kernel,
    buffer_plan,
    check_shape,
    descriptors,
    gluon_chunk_local_states,
    gluon_chunk_states,
    gluon_segment_end_states,
    half_columns,
    ring_weights,
    shared_bytes,
)
from mamba3_mimo.ops.host_utils import cdiv  # noqa: E402
from mamba3_mimo.ops.production import choose_config  # noqa: E402

def compile_for_sm90(case, *, role="local", block_p=None, num_buffers=None, chunks_per_segment=32, gdc=False,
                     max_registers=MAX_REGISTERS, half_rotation=False, store_buffers=None, operand_buffers=None,
                     weights_in_ring=None, from_angles=False):
    """The probe in one of its ``ROLES`` compiled for sm_90 on an official shape (B=4, S=2048, H=16, G=1), no GPU
    needed; ``gdc``: as launched under ``launch.dependent_launches`` (its wait and trigger compiled in);
    ``max_registers``: the launch's register cap; ``half_rotation``: k's bias add and rotation in bf16;
    ``store_buffers`` / ``operand_buffers``: state-store buffers and sets of update operands (default: the wrappers'
    choices, ``state_store_buffers`` and ``update_operand_buffers``); ``weights_in_ring``: the weights through the ring
    (default: the wrappers' choice, ``ring_weights``); ``from_angles``: the fp32 angles' boxes in place of the
    cos / sin tables, their values computed in the consumer (``ScanConfig.angles_in_kernels``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    shape = parse_case(case)
    N, P, R, C = shape["N"], shape["P"], shape["R"], shape["chunk_size"]
    block_p = block_p or min(P, 64)
    num_buffers, operand_buffers, store_buffers = buffer_plan(
        C=C, R=R, block_p=block_p, N=N, store_states=ROLES[role][0], num_buffers=num_buffers,
        operand_buffers=operand_buffers, store_buffers=store_buffers)
    B, S, H, G = 4, 2048, 16, 1
    # Descriptors only need real strides and dtypes here: tiny CPU tensors viewed with the official shapes.
    base = {dtype: torch.empty(16, dtype=dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    check_shape(B=B, S=S, R=R, G=G, N=N, H=H, P=P, RD=N // 4, chunk_size=C, block_p=block_p,
                dtypes=(torch.bfloat16, torch.float16, torch.bfloat16), store_states=ROLES[role][0])
    fake = dict(k=_Shaped(base[torch.bfloat16], (B, S, R, G, N)), v=_Shaped(base[torch.bfloat16], (B, S, H, P)),
                cos_angles=_Shaped(base[torch.float16], (B, S, H, N // 4)),
                sin_angles=_Shaped(base[torch.float16], (B, S, H, N // 4)),
                states=_Shaped(base[torch.bfloat16], (B, H, S // C, N, P)))
    if from_angles:
        fake.update(cos_angles=None, sin_angles=None, angles=_Shaped(base[torch.float32], (B, S, H, N // 4)))
    types = {name: mangle_type(desc) for name, desc in descriptors(**fake, chunk_size=C, block_p=block_p).items()}
    types.update({name: "*fp32" for name in ("da_rev_ptr", "trap_scale_ptr", "da_cs_ptr", "k_bias_ptr", "psi_ptr",
                                             "seg_state_ptr")})
    types.update({name: "i32" for name in ("S", "H", "G", "NCH", "CHUNKS_PER_SEG", "N_SEGMENTS")})
    store_states, fold_earlier, store_end = ROLES[role]
    constants = dict(C=C, R=R, N=N, P=P, RD=N // 4, BLOCK_P=block_p, NUM_BUFFERS=num_buffers,
                     STORE_STATES=store_states, FOLD_EARLIER=fold_earlier, STORE_END=store_end,
                     BLOCK_SEG_CHUNKS=triton.next_power_of_2(chunks_per_segment), num_warps=4, GDC=gdc,
                     HALF_ROTATION=half_rotation, STORE_BUFFERS=store_buffers, OPERAND_BUFFERS=operand_buffers,
                     RING_WEIGHTS=(ring_weights(C=C, N=N, P=P, block_p=block_p) if weights_in_ring is None
                                   else weights_in_ring),
                     TABLE_DTYPE=(tl.bfloat16 if half_rotation else tl.float16) if from_angles else None)
    types.update({name: "constexpr" for name in constants})
    signature = {name: types[name] for name in _gluon_scan_kernel.arg_names}  # in the kernel's order
    source = GluonASTSource(_gluon_scan_kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=max_registers,
                                                                                   launch_pdl=gdc))


class _Shaped:
    """A stand-in with a tensor's dtype, data pointer, shape and contiguous strides (descriptor metadata only)."""

    def __init__(self, tensor, shape):
        self.dtype, self.shape, self._tensor = tensor.dtype, torch.Size(shape), tensor
        strides, step = [], 1
        for size in reversed(shape):
            strides.append(step)
            step *= size
        self._strides = tuple(reversed(strides))

    def data_ptr(self):
        return self._tensor.data_ptr()

    def stride(self):
        return self._strides


def summary(kernel):
    """Resources, the register split the PTX asks for, and the consumer's chunk loop in SASS (the innermost loop
    around the wgmma): its length and its shared-memory traffic, barriers and TMA operations."""
    import aot_report
    import sass_report

    ops = sass_report.sass_ops(kernel)
    loops = []
    for address, opcode, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            body = [op for a, op, _ in ops if int(target.group(1), 16) <= a <= address]
            if any(op.startswith("HGMMA") for op in body):
                loops.append(body)
    loop = min(loops, key=len) if loops else []
    opcodes = collections.Counter(op.split(".")[0] for op in loop)
    ptx = kernel.asm["ptx"]
    return dict(**aot_report.resources(kernel),
                setmaxnreg=sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
                loop=len(loop), **{op: opcodes[op] for op in ("LDS", "STS", "STSM", "BAR", "HGMMA", "LDG")})


def read_box(desc, coords):
    """What a TMA load of ``desc`` at ``coords`` puts in shared memory (elements past the tensor's shape read as
    zeros), read on the host from the descriptor's own base, shape and strides."""
    view = torch.as_strided(desc.base, desc.shape, desc.strides)
    box = torch.zeros(desc.block_shape, dtype=desc.base.dtype)
    inside = tuple(slice(0, max(0, min(size, dim - start))) for size, dim, start in
                   zip(desc.block_shape, desc.shape, coords))
    box[inside] = view[tuple(slice(start, start + piece.stop) for start, piece in zip(coords, inside))]
    return box


def emulate(*, role, k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, trap_scale, states, seg_state,
            chunk_size, n_segments, chunks_per_segment, block_p, **_unused):
    """The kernel's programs in one of its ``ROLES``, step by step in torch on the host (fp32 products): the boxes its
    producer asks for (``descriptors`` and the same coordinates), the consumer's fold, rotation, weights and update,
    its stores into ``states`` (bf16; None in the "end" role) and ``seg_state`` (fp32, read by "store").  It checks
    the descriptors and the index arithmetic on the CPU, where Gluon cannot run; the Gluon code itself is checked on
    the GPU."""
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    RD = cos_angles.shape[3]
    # BH: the columns of each half a program holds (at N = 64 the kernel stacks its two 32-row halves in one
    # accumulator: the same arithmetic as two pieces here).
    C, HALF, BH, nch = chunk_size, N // 2, half_columns(N), cdiv(S, chunk_size)
    store_states, fold_earlier, store_end = ROLES[role]
    if states is None:
        states = torch.empty((1, 1, 1, STATE_ROWS, block_p), dtype=torch.bfloat16)
    check_shape(B=B, S=S, R=R, G=G, N=N, H=H, P=P, RD=RD, chunk_size=C, block_p=block_p,
                dtypes=(k.dtype, cos_angles.dtype, states.dtype), store_states=store_states)
    found = descriptors(k=k, v=v, cos_angles=cos_angles, sin_angles=sin_angles, states=states, chunk_size=C,
                        block_p=block_p)
    states_rows = torch.as_strided(states, found["states_desc"].shape, found["states_desc"].strides)
    segments = n_segments - 1 if role == "end" else n_segments
    for n0, p0, seg, bh in itertools.product(range(0, HALF, BH), range(0, P, block_p), range(segments),
                                             range(B * H)):
        b, h = divmod(bh, H)
        g = h // (H // G)
        c_first = seg * chunks_per_segment
        pieces = (slice(n0, n0 + BH), slice(HALF + n0, HALF + n0 + BH))  # this program's rows of each half
        p_tile = slice(p0, p0 + block_p)
        rotated = n0 + torch.arange(BH) < RD
        state = torch.zeros(2, BH, block_p)
        for earlier in range(seg if fold_earlier else 0):
            chunk_ends = (earlier * chunks_per_segment + torch.arange(chunks_per_segment)) * C + C - 1
            segment_decay = da_cs.reshape(-1)[bh * S + chunk_ends].sum().exp()
            state = segment_decay * state + torch.stack([seg_state[b, h, earlier, rows, p_tile] for rows in pieces])
        for i in range(min(chunks_per_segment, nch - c_first)):
            row, token = b * S + (c_first + i) * C, bh * S + (c_first + i) * C
            for half in range(2 if store_states else 0):
                first = (bh * nch + c_first + i) * N + half * HALF + n0
                states_rows[first:first + BH, p_tile] = state[half].to(states.dtype)
            k_lo = read_box(found["k_desc"], [0, row, g * N + n0]).float() + k_bias[h, :, None, pieces[0]]
            k_hi = read_box(found["k_desc"], [0, row, g * N + HALF + n0]).float() + k_bias[h, :, None, pieces[1]]
            cos = torch.where(rotated, read_box(found["cos_desc"], [row, h * RD + n0]).float(), 1.0)
            sin = torch.where(rotated, read_box(found["sin_desc"], [row, h * RD + n0]).float(), 0.0)
            weight = da_cs_rev.reshape(-1)[token:token + C].exp() * trap_scale.reshape(-1)[token:token + C]
            decay = da_cs.reshape(-1)[token + C - 1].exp()
            v_weighted = read_box(found["v_desc"], [row, h * P + p0]).float() * weight[:, None]
            psiv = (v_weighted[None] * mimo_v[h, :, None, p_tile]).reshape(R * C, block_p)
            a_lo = (cos * k_lo - sin * k_hi).reshape(R * C, BH)
            a_hi = (sin * k_lo + cos * k_hi).reshape(R * C, BH)
            state = decay * state + torch.stack([a_lo.T @ psiv, a_hi.T @ psiv])
        if store_end and seg < n_segments - 1:
            for half, rows in enumerate(pieces):
                seg_state[b, h, seg, rows, p_tile] = state[half]


def production_summary(case):
    """The production scan that stores ``states`` on an official shape as the dispatcher runs it, compiled for sm_90
    (``tma_scan_probe.loop_summary``: resources and its chunk loop), for comparison."""
    import aot_report
    from tma_scan_probe import loop_summary

    aot_report.compile_as_cuda()  # the launches are captured from CPU tensors, as aot_report does
    for name, args, kwargs in aot_report.official_launches(case):
        if name == "state_scan" and kwargs["STORE_STATES"]:
            return dict(num_warps=kwargs.get("num_warps"), local=bool(kwargs["STORE_END"]),
                        **loop_summary(aot_report.compile_launch(name, args, kwargs)))
    return {}


def poisoned(shape, device, dtype=torch.bfloat16):
    """An output tensor filled with NaN: an element a kernel leaves unwritten reads as an infinite error."""
    return torch.full(shape, float("nan"), device=device, dtype=dtype)


def check_case(case, *, seed=0, num_buffers=None):
    """GPU, an official shape (bf16, the dispatcher's segments, P tile and rotation dtype): {role: max relative error
    of the kernel's outputs against the production scan's in that role}."""
    from mamba3_mimo.ops.chunk_state import chunk_states, segment_end_states

    inputs, scan = _official_scan(case, seed=seed)
    n_segments = scan.pop("n_segments")
    B, S, _, _, N = inputs["k"].shape
    H, P = inputs["v"].shape[2:]
    shape, segment_shape = (B, H, S // inputs["chunk_size"], N, P), (B, H, n_segments, N, P)

    common = dict(scan, n_segments=n_segments, num_buffers=num_buffers)
    got, got_end = poisoned(shape, "cuda"), poisoned(segment_shape, "cuda", torch.float32)
    gluon_chunk_local_states(**common, states=got, seg_state=got_end)
    expected = poisoned(shape, "cuda")
    expected_end = chunk_local_states(**scan, n_segments=n_segments, states=expected, span_chunks=1)
    errors = dict(local=max_relative_error((got, got_end), (expected, expected_end), n_segments))
    if n_segments > 1:
        written = slice(0, n_segments - 1)
        got_end = gluon_segment_end_states(**common, seg_state=poisoned(segment_shape, "cuda", torch.float32))
        expected_end = segment_end_states(**scan, n_segments=n_segments, span_chunks=1)
        errors["end"] = max_relative_error((got_end[:, :, written], got_end), (expected_end[:, :, written],
                                                                               expected_end), n_segments)
        got, expected = poisoned(shape, "cuda"), poisoned(shape, "cuda")
        gluon_chunk_states(**common, seg_state=expected_end, states=got)
        chunk_states(**scan, n_segments=n_segments, seg_state=expected_end, states=expected, span_chunks=1)
        errors["store"] = max_relative_error((got, expected_end), (expected, expected_end), n_segments)
    return errors


def _compare_roles(inputs, *, run, device, dot_dtype, num_warps, rotation_math_dtype=tl.float32):
    """{"local", "end", "store": max relative error of ``run``'s outputs in that role against the production scan's;
    "golden_local", "golden_store": the normwise error of its final states against the float64 reference}, on
    ``inputs`` with three segments (the last one shorter) and with one.  ``run(role, scan, states, seg_state)``
    writes ``states`` and ``seg_state`` as the kernel would."""
    from mamba3_mimo.accuracy import normwise_error
    from mamba3_mimo.ops.chunk_state import chunk_states, segment_end_states
    from mamba3_mimo.reference import bwd_fwd_reference

    B, S, _, _, N = inputs["k"].shape
    H, P = inputs["v"].shape[2:]
    shape = (B, H, S // inputs["chunk_size"], N, P)
    golden = bwd_fwd_reference(**{name: value.cpu() if torch.is_tensor(value) else value
                                  for name, value in inputs.items()})[0]

    errors = {}
    for n_segments in (3, 1):
        scan = scan_arguments(inputs, n_segments=n_segments, block_half=N // 2, block_p=64, num_warps=num_warps,
                              dot_dtype=dot_dtype, dot_precision="ieee", rotation_math_dtype=rotation_math_dtype)
        n_segments = scan.pop("n_segments")
        segment_shape = (B, H, n_segments, N, P)
        got, got_end = poisoned(shape, device), poisoned(segment_shape, device, torch.float32)
        run("local", scan, n_segments, got, got_end)
        if n_segments == 1:
            errors["golden_local"] = normwise_error(got.cpu(), golden)
            continue
        expected = poisoned(shape, device)
        expected_end = chunk_local_states(**scan, n_segments=n_segments, states=expected, span_chunks=1)
        errors["local"] = max_relative_error((got, got_end), (expected, expected_end), n_segments)
        # Two passes: the end states, then the stored states folded from them.
        got_end = poisoned(segment_shape, device, torch.float32)
        run("end", scan, n_segments, None, got_end)
        expected_end = segment_end_states(**scan, n_segments=n_segments, span_chunks=1)
        written = slice(0, n_segments - 1)  # the last segment's end state is never written
        errors["end"] = max_relative_error((got_end[:, :, written], got_end), (expected_end[:, :, written],
                                                                               expected_end), n_segments)
        # The storing pass from the production's end states, so that it is checked on its own.
        got, expected = poisoned(shape, device), poisoned(shape, device)
        run("store", scan, n_segments, got, expected_end)
        chunk_states(**scan, n_segments=n_segments, seg_state=expected_end, states=expected, span_chunks=1)
        errors["store"] = max_relative_error((got, expected_end), (expected, expected_end), n_segments)
        errors["golden_store"] = normwise_error(got.cpu(), golden)
    return errors


def small_problem(N, device="cpu"):
    """A small bf16 problem for the role checks: at N = 64 (the halves stacked) and N = 128 two head groups and two
    P tiles, at N = 256 two N/2 tiles, both rotated (RD = N/2); dA_scale 0.1 makes a segment decay by ~e^-1, so that
    the fold of earlier segments weighs in."""
    shape = (dict(B=1, S=256, H=4, G=2, N=N, P=128, R=4, chunk_size=16) if N in (64, 128) else
             dict(B=1, S=128, H=2, G=1, N=256, P=64, R=4, chunk_size=8, rotary_dim_divisor=2))
    if device != "cpu":
        shape["B"] = 2
    return make_inputs(**shape, dtype=torch.bfloat16, seed=5, dA_scale=0.1, device=device)


def check_emulation(N=128):
    """CPU (the interpreter for the production scan): ``emulate`` in each role on ``small_problem(N)``, as
    ``check_small`` runs the kernel on the GPU."""
    inputs = small_problem(N)

    def run(role, scan, n_segments, states, seg_state):
        emulate(role=role, **scan, n_segments=n_segments, states=states, seg_state=seg_state)

    # fp32 products in the production scan: the interpreter miscomputes bf16 tl.dot (SPEC section 10).
    return _compare_roles(inputs, run=run, device="cpu", dot_dtype=tl.float32, num_warps=4)


def check_small(*, N=128, num_buffers=None, half_rotation=False):
    """GPU: the kernel in each role on ``small_problem(N)`` with three segments (the last one shorter) and with one
    (``_compare_roles``); ``half_rotation``: k's bias add and rotation in bf16, the production scans' too."""
    inputs = small_problem(N, device="cuda")
    wrappers = dict(local=gluon_chunk_local_states, end=gluon_segment_end_states, store=gluon_chunk_states)

    def run(role, scan, n_segments, states, seg_state):
        if role != "end":
            scan = dict(scan, states=states)
        wrappers[role](**scan, n_segments=n_segments, seg_state=seg_state, num_buffers=num_buffers)

    return _compare_roles(inputs, run=run, device="cuda", dot_dtype=tl.bfloat16, num_warps=8,
                          rotation_math_dtype=tl.bfloat16 if half_rotation else tl.float32)


def _official_scan(case, *, seed, n_segments=None):
    shape = parse_case(case)
    config = choose_config(B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                           has_z=True, **shape)
    inputs = make_inputs(B=4, S=2048, H=16, G=1, dtype=torch.bfloat16, device="cuda", seed=seed, **shape)
    scan = scan_arguments(inputs, n_segments=n_segments or config.n_segments, block_half=config.block_half,
                          block_p=config.block_p, num_warps=config.num_warps, dot_dtype=tl.bfloat16,
                          dot_precision="ieee",
                          rotation_math_dtype=tl.bfloat16 if config.scan_half_rotation else tl.float32)
    return inputs, scan


def time_case(case, reps):
    """ms of the production scans as the dispatcher configures them (tiles, segments, spans) and of the Gluon
    kernel in the same roles, at the dispatcher's segment count and at twice it: the local-state pass, and the two
    passes (end states, then the stored states), with the Gluon kernel's errors (``check_case``)."""
    from mamba3_mimo.ops.chunk_state import chunk_states, segment_end_states

    shape = parse_case(case)
    config = choose_config(B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                           has_z=True, **shape)
    record = dict(case=case, dispatcher_local=config.local_states, errors=check_case(case))
    for segments in (config.n_segments, 2 * config.n_segments):
        inputs, scan = _official_scan(case, seed=0, n_segments=segments)
        n_segments = scan.pop("n_segments")
        states = torch.empty((4, 16, 2048 // inputs["chunk_size"], shape["N"], shape["P"]), device="cuda",
                             dtype=torch.bfloat16)
        end = segment_end_states(**scan, n_segments=n_segments, span_chunks=config.end_span_chunks)

        def bench(fn):
            return triton.testing.do_bench(fn, rep=reps)

        timed = dict(
            production_local=lambda: chunk_local_states(**scan, n_segments=n_segments, states=states,
                                                        span_chunks=config.state_span_chunks),
            gluon_local=lambda: gluon_chunk_local_states(**scan, n_segments=n_segments, states=states),
            production_end=lambda: segment_end_states(**scan, n_segments=n_segments,
                                                      span_chunks=config.end_span_chunks),
            gluon_end=lambda: gluon_segment_end_states(**scan, n_segments=n_segments),
            production_store=lambda: chunk_states(**scan, n_segments=n_segments, seg_state=end, states=states,
                                                  span_chunks=config.state_span_chunks),
            gluon_store=lambda: gluon_chunk_states(**scan, n_segments=n_segments, seg_state=end, states=states),
        )
        for name, fn in timed.items():
            try:
                record[f"{name}_seg{n_segments}_ms"] = bench(fn)
            except Exception as error:  # a variant that fails to launch is a finding, not a crash
                record[f"{name}_seg{n_segments}_failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return record


GLUON_CASES = ["N256_P64_R4_C8", "N128_P64_R4_C16", "N128_P32_R4_C16", "N128_P128_R4_C8", "N128_P64_R8_C8",
               "N128_P64_R2_C32", "N128_P64_R1_C64", "N64_P64_R4_C16", "N64_P128_R4_C16"]


def compile_records(case, roles, with_production=False):
    """--compile-only's records for one case: each role compiled at the P tile and ring depth the wrappers choose."""
    shape = parse_case(case)
    C, R, N, block_p = shape["chunk_size"], shape["R"], shape["N"], min(shape["P"], 64)
    records = [dict(case=case, kernel="production storing scan", **production_summary(case))] if with_production else []
    for role in roles:
        store_states = ROLES[role][0]
        depth, operands, stores = buffer_plan(C=C, R=R, block_p=block_p, N=N, store_states=store_states)
        model = shared_bytes(C=C, R=R, block_p=block_p, num_buffers=depth, N=N, store_states=store_states,
                             store_buffers=stores, operand_buffers=operands,
                             ring_weights=ring_weights(C=C, N=N, P=shape["P"], block_p=block_p))
        records.append(dict(case=case, role=role, block_p=block_p, num_buffers=depth, store_buffers=stores,
                            operand_buffers=operands,
                            shared_model=model,
                            **summary(compile_for_sm90(case, role=role, block_p=block_p, num_buffers=depth))))
    return records


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=GLUON_CASES)
    parser.add_argument("--roles", nargs="+", default=list(ROLES), choices=list(ROLES),
                        help="with --compile-only: the kernel's roles to compile")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--with-production", action="store_true",
                        help="with --compile-only: also the production scan that stores states, for comparison")
    parser.add_argument("--reps", type=int, default=200, help="do_bench's rep (ms)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    records = []
    if not args.compile_only:
        for N in (64, 128, 256):
            records.append(dict(case=f"small N={N}", **check_small(N=N)))
            print(records[-1], flush=True)
    for case in args.cases:
        found = (compile_records(case, args.roles, args.with_production) if args.compile_only
                 else [time_case(case, args.reps)])
        for record in found:
            print(record, flush=True)
        records += found
    if args.json:
        with open(args.json, "w") as out:
            json.dump(records, out, indent=1)


if __name__ == "__main__":
    main()
