"""The fused storing scan (mamba3_mimo/ops/gluon_scan_outputs.py) compiled for sm_90 on the CPU: resources, the
register split and its chunk loop's SASS, per official shape it covers.

    python benchmarks/gluon_scan_outputs_probe.py [--json F]
"""

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

from gluon_scan_probe import _Shaped, parse_case, summary  # noqa: E402

from mamba3_mimo.ops.gluon_scan_outputs import (  # noqa: E402
    MAX_REGISTERS,
    _scan_outputs_kernel,
    descriptors,
    GateForm,
    plan,
    shape_problems,
)

# The official shapes the kernel covers (N = 64 or 128, C * R = 64).
CASES = ["N128_P64_R4_C16", "N128_P32_R4_C16", "N128_P64_R8_C8", "N128_P64_R2_C32", "N64_P64_R4_C16",
         "N64_P128_R4_C16"]


def compile_for_sm90(case, *, half_rotation=False, from_angles=True, chunks_per_segment=64, scaled_raw_y=True,
                     block_p=None, ring_weights=False, gate=None, d_skip=False, weights_ahead=False,
                     token_weights=False):
    """The kernel compiled for sm_90 on an official shape (B=4, S=2048, H=16, G=1), no GPU needed, at ``plan``'s P
    tile (``block_p``: that one), with the per-token weights through the ring where ``ring_weights``, and with the
    gate in the pass where ``gate`` is given (``dict(has_z=..., has_d=...)``; bf16 activations and dz), or with the D
    skip added to raw_y where ``d_skip``, with the log decays loaded a step ahead where ``weights_ahead``, with the
    intra-chunk weights once a (row, column token) where ``token_weights``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    shape = parse_case(case)
    N, P, R, C = shape["N"], shape["P"], shape["R"], shape["chunk_size"]
    B, S, H = 4, 2048, 16
    table = torch.bfloat16 if half_rotation else torch.float16
    form = GateForm(**gate) if gate else None
    problems = shape_problems(S=S, R=R, N=N, P=P, chunk_size=C, dtypes=(torch.bfloat16,) * 4 + (table,),
                              half_rotation=half_rotation, block_p=block_p, ring_weights=ring_weights,
                              gate_form=form, d_skip=d_skip)
    assert not problems, problems
    layout = plan(C=C, R=R, P=P, half_rotation=half_rotation, block_p=block_p, ring_weights=ring_weights,
                  gate_form=form, N=N, d_skip=d_skip)
    base = {dtype: torch.empty(16, dtype=dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    fake = dict(q=_Shaped(base[torch.bfloat16], (B, S, R, 1, N)), k=_Shaped(base[torch.bfloat16], (B, S, R, 1, N)),
                v=_Shaped(base[torch.bfloat16], (B, S, H, P)),
                cos_angles=_Shaped(base[table], (B, S, H, N // 4)), sin_angles=_Shaped(base[table], (B, S, H, N // 4)),
                states=_Shaped(base[torch.bfloat16], (B, H, S // C, N, P)))
    if from_angles:
        fake.update(cos_angles=None, sin_angles=None, angles=_Shaped(base[torch.float32], (B, S, H, N // 4)))
    found = descriptors(**fake, chunk_size=C, block_p=layout.block_p)
    types = {name: mangle_type(desc) for name, desc in found.items()}
    types.update({name: "*fp32" for name in ("da_cs_ptr", "da_rev_ptr", "gamma_ptr", "trap_scale_ptr", "q_bias_ptr",
                                             "k_bias_ptr", "psi_ptr", "seg_state_ptr", "raw_y_scale_ptr")})
    types.update(raw_y_ptr="*fp16" if scaled_raw_y else "*fp32", qk_dot_ptr="*bf16")
    # The gate's arguments: qk_dot stand-ins without it (as the wrapper passes them).
    types.update({name: "*bf16" for name in ("dout_ptr", "z_ptr", "v_ptr", "phi_ptr", "zeta_ptr", "d_ptr", "dz_ptr",
                                              "dphi_ptr", "dzeta_ptr")})
    if d_skip:
        types.update(d_ptr="*fp32")
    if gate:
        types.update(raw_y_ptr="*bf16", raw_y_scale_ptr="*bf16",
                     **{name: "*fp32" for name in ("phi_ptr", "zeta_ptr", "d_ptr", "dphi_ptr", "dzeta_ptr")})
    types.update({name: "i32" for name in ("S", "H", "G", "NCH", "CHUNKS_PER_SEG", "N_SEGMENTS")})
    constants = dict(C=C, R=R, N=N, P=P, RD=N // 4, BLOCK_P=layout.block_p, NUM_BUFFERS=layout.num_buffers,
                     BLOCK_SEG_CHUNKS=triton.next_power_of_2(chunks_per_segment), num_warps=4,
                     HALF_ROTATION=half_rotation, SCALED_RAW_Y=scaled_raw_y,
                     TABLE_DTYPE=(tl.bfloat16 if half_rotation else tl.float16) if from_angles else None,
                     Q_IN_PLACE=layout.q_in_place, WEIGHED_BUFFER=layout.weighed_buffer, RING_WEIGHTS=ring_weights,
                     GATE=bool(gate), HAS_Z=bool(gate and gate["has_z"]), HAS_D=bool(gate and gate["has_d"]) or d_skip,
                     WEIGHTS_AHEAD=weights_ahead, TOKEN_WEIGHTS=token_weights)
    types.update({name: "constexpr" for name in constants})
    signature = {name: types[name] for name in _scan_outputs_kernel.arg_names}
    source = GluonASTSource(_scan_outputs_kernel, signature, constants)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAX_REGISTERS))


def global_copies(kernel):
    """The whole kernel's global loads into registers (LDG), cp.async copies into shared memory (LDGSTS),
    special-function instructions (MUFU: exp, sin, cos) and instructions, in SASS."""
    import sass_report

    opcodes = [op.split(".")[0] for _, op, _ in sass_report.sass_ops(kernel)]
    return dict(kernel_LDG=opcodes.count("LDG"), kernel_LDGSTS=opcodes.count("LDGSTS"),
                kernel_MUFU=opcodes.count("MUFU"), kernel_SASS=len(opcodes))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--cases", nargs="*", default=CASES)
    args = parser.parse_args(argv)
    records = []
    for case in args.cases:
        shape = parse_case(case)
        P, N = shape["P"], shape["N"]
        # Each P tile (128 at N = 64) with either rotation, and the dispatcher's form (the widest tile, bf16 rotation)
        # with the per-token weights through the ring.
        tiles = [width for width in (32, 64, 128) if P % width == 0 and (width < 128 or N == 64)]
        widest = plan(C=shape["chunk_size"], R=shape["R"], P=P, half_rotation=True, N=N).block_p
        variants = [(block_p, half_rotation, False, None, False, False) for block_p in tiles
                    for half_rotation in (False, True)] + [(widest, True, True, None, False, False)]
        # The gate in the pass, in the dispatcher's form: with Z and D (the official grid), and without Z.
        gate_tile = min(widest, 64)
        variants += [(gate_tile, True, False, dict(has_z=has_z, has_d=True), False, False) for has_z in (True, False)]
        # The D skip added to the stored raw_y, in the dispatcher's form.
        variants += [(widest, True, False, None, True, False)]
        # The log decays a step ahead where the dispatcher takes them (N = 128, 16-token chunks, the ring weights):
        # with Z, and with the gate without Z.
        if N == 128 and shape["chunk_size"] == 16:
            variants += [(widest, True, True, None, False, True),
                         (gate_tile, True, True, dict(has_z=False, has_d=True), False, True)]
        variants = [variant + (False,) for variant in variants]
        # The intra-chunk weights once a (row, column token), in the dispatcher's form with Z and without.
        ring = N == 128 and shape["chunk_size"] >= 16
        ahead = N == 128 and shape["chunk_size"] == 16
        variants += [(widest, True, ring, None, False, ahead, True),
                     (gate_tile, True, ring, dict(has_z=False, has_d=True), False, ahead, True)]
        for block_p, half_rotation, ring_weights, gate, d_skip, weights_ahead, token_weights in variants:
            layout = plan(C=parse_case(case)["chunk_size"], R=parse_case(case)["R"], P=P,
                          half_rotation=half_rotation, block_p=block_p, ring_weights=ring_weights,
                          gate_form=GateForm(**gate) if gate else None, N=parse_case(case)["N"], d_skip=d_skip)
            kernel = compile_for_sm90(case, half_rotation=half_rotation, block_p=block_p, ring_weights=ring_weights,
                                      gate=gate, d_skip=d_skip, weights_ahead=weights_ahead,
                                      token_weights=token_weights)
            record = dict(case=case, half_rotation=half_rotation, ring_weights=ring_weights, gate=gate,
                          d_skip=d_skip, weights_ahead=weights_ahead, token_weights=token_weights,
                          **layout._asdict(), **summary(kernel),
                          **global_copies(kernel))
            print(record, flush=True)
            records.append(record)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(records, out, indent=1)


if __name__ == "__main__":
    main()
