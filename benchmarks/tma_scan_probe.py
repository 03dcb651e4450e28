"""Probe: the local-state scan with its loads as TMA tensor-descriptor boxes, with and without warp specialization.

    python benchmarks/tma_scan_probe.py                    # GPU: time against chunk_local_states, check the states
    python benchmarks/tma_scan_probe.py --compile-only     # no GPU: resources and loop SASS for sm_90
    TRITON_INTERPRET=1 python benchmarks/tma_scan_probe.py --small    # CPU: the values only

Not a production kernel.  It answers one question before a rewrite is worth starting (docs/optimization.md
section 32): do the state scans, which run at 28-35% of their issue rate and wait on their loads, gain when a
step's tiles arrive as TMA boxes through a shared-memory ring (``num_stages``), or from a producer warp that
streams them while the other warps compute (``warp_specialize``, which Triton applies on Hopper to loops of
descriptor loads only)?  ``chunk_local_states`` gathers its rows with 64-bit pointer tiles and masks instead.

What it showed without a GPU (``--compile-only``; benchmarks/results/2026-12-05_tma_scan_probe_static_c7b3ba2.log):
Triton 3.6 does not partition this loop into producer and consumer warps (``warp_specialize`` fails to compile at
N = 128 and elsewhere gives the plain loop: no ``setmaxnreg`` in the PTX), and the descriptor loads put the tiles in
layouts the rest of the step converts through shared memory: the chunk loop is 1.2-2.5x the instructions of
``chunk_local_states``' (N256 tiles: 711-823 against 333) at more registers (159-194 against 113: one 8-warp program
an SM instead of two).  The prediction for the GPU is that it loses everywhere but perhaps N16; the timing
(``sweep_prepared.sh`` part 9) would confirm it for a minute of device time.

The kernel computes what ``chunk_local_states`` computes with one chunk a step and the fp32 rotation, for shapes
whose chunk rows form boxes: C and R powers of two, P a multiple of the P tile, N/2 a multiple of the N/2 tile.
A chunk's (token, rank) rows of k are consecutive rows of k viewed as [B, S * R, G * N]; its tokens' cos / sin
and v rows are boxes of [B, S, H * RD] and [B, S, H * P] (rows past S read as zeros: the tensor's bound).
"""

import argparse
import collections
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mamba3_mimo.bench import parse_case  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.ops.chunk_state import chunk_local_states  # noqa: E402
from mamba3_mimo.ops.host_utils import cdiv  # noqa: E402
from mamba3_mimo.ops.production import choose_config, rotation_table_dtype  # noqa: E402
from mamba3_mimo.ops.token_tables import token_tables  # noqa: E402
from mamba3_mimo.ops.triton_utils import chunk_log_decay_at, rotate_half  # noqa: E402

# (num_stages, warp_specialize) of the probe's chunk loop.
VARIANTS = ((1, False), (2, False), (3, False), (2, True), (3, True))


@triton.jit
def _tokens_to_rows(tile, C: tl.constexpr, R: tl.constexpr, COLS: tl.constexpr):
    """[C, COLS] per-token tile -> [C * R, COLS], row t * R + r holding token t's row."""
    return tl.reshape(tl.broadcast_to(tile[:, None, :], (C, R, COLS)), (C * R, COLS))


@triton.jit
def _ranks_to_rows(tile, C: tl.constexpr, R: tl.constexpr, COLS: tl.constexpr):
    """[R, COLS] per-rank tile -> [C * R, COLS], row t * R + r holding rank r's row."""
    return tl.reshape(tl.broadcast_to(tile[None, :, :], (C, R, COLS)), (C * R, COLS))


@triton.jit
def _tma_local_scan_kernel(
    k_ptr, v_ptr, cos_ptr, sin_ptr, k_bias_ptr, psi_ptr, da_cs_ptr, da_rev_ptr, trap_scale_ptr,
    seg_state_ptr, states_ptr,
    B, S, H, G, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, R: tl.constexpr, N: tl.constexpr, P: tl.constexpr, RD: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    HALF: tl.constexpr = N // 2
    ROWS: tl.constexpr = C * R
    P_TILES: tl.constexpr = P // BLOCK_P
    pid_n = tl.program_id(0) // P_TILES
    pid_p = tl.program_id(0) % P_TILES
    seg = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = (bh // H).to(tl.int32)
    h = (bh % H).to(tl.int32)
    g = h // (H // G)
    n0 = pid_n * BLOCK_HALF
    p0 = pid_p * BLOCK_P

    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[B, S * R, G * N], strides=[S * R * G * N, G * N, 1],
                                       block_shape=[1, ROWS, BLOCK_HALF])
    cos_desc = tl.make_tensor_descriptor(cos_ptr, shape=[B, S, H * RD], strides=[S * H * RD, H * RD, 1],
                                         block_shape=[1, C, BLOCK_HALF])
    sin_desc = tl.make_tensor_descriptor(sin_ptr, shape=[B, S, H * RD], strides=[S * H * RD, H * RD, 1],
                                         block_shape=[1, C, BLOCK_HALF])
    v_desc = tl.make_tensor_descriptor(v_ptr, shape=[B, S, H * P], strides=[S * H * P, H * P, 1],
                                       block_shape=[1, C, BLOCK_P])

    offs_half = n0 + tl.arange(0, BLOCK_HALF)
    offs_p = p0 + tl.arange(0, BLOCK_P)
    rank = tl.arange(0, R)
    tok = tl.arange(0, C)
    # The per-rank factors of every step, expanded to rows once.
    bias_offs = (h * R + rank[:, None]) * N + offs_half[None, :]
    bias_lo = _ranks_to_rows(tl.load(k_bias_ptr + bias_offs), C, R, BLOCK_HALF)
    bias_hi = _ranks_to_rows(tl.load(k_bias_ptr + bias_offs + HALF), C, R, BLOCK_HALF)
    psi = tl.load(psi_ptr + (h * R + rank[:, None]) * P + offs_p[None, :])
    # Columns n >= RD of each half are not rotated; the boxes there hold other heads' angles (or zeros).
    rotated = (offs_half < RD)[None, :]

    disc_seq = bh * S
    states_seq = states_ptr + bh * NCH * N * P
    tile_offs = offs_half[:, None] * P + offs_p[None, :]
    state_lo = tl.zeros((BLOCK_HALF, BLOCK_P), dtype=tl.float32)
    state_hi = tl.zeros((BLOCK_HALF, BLOCK_P), dtype=tl.float32)
    for i in tl.range(0, CHUNKS_PER_SEG, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        c = seg * CHUNKS_PER_SEG + i
        t0 = c * C
        chunk_ok = c < NCH
        tl.store(states_seq + c * N * P + tile_offs, state_lo.to(states_ptr.dtype.element_ty), mask=chunk_ok)
        tl.store(states_seq + c * N * P + HALF * P + tile_offs, state_hi.to(states_ptr.dtype.element_ty),
                 mask=chunk_ok)
        k_lo = tl.reshape(k_desc.load([b, t0 * R, g * N + n0]), (ROWS, BLOCK_HALF)).to(tl.float32) + bias_lo
        k_hi = tl.reshape(k_desc.load([b, t0 * R, g * N + HALF + n0]), (ROWS, BLOCK_HALF)).to(tl.float32) + bias_hi
        cos_tok = tl.reshape(cos_desc.load([b, t0, h * RD + n0]), (C, BLOCK_HALF)).to(tl.float32)
        sin_tok = tl.reshape(sin_desc.load([b, t0, h * RD + n0]), (C, BLOCK_HALF)).to(tl.float32)
        cos_rows = _tokens_to_rows(tl.where(rotated, cos_tok, 1.0), C, R, BLOCK_HALF)
        sin_rows = _tokens_to_rows(tl.where(rotated, sin_tok, 0.0), C, R, BLOCK_HALF)
        k_lo, k_hi = rotate_half(k_lo, k_hi, cos_rows, sin_rows)
        # Rows past S: k~ is only the bias there, and their weight is 0.
        t = t0 + tok
        tok_ok = t < S
        weight = tl.exp(tl.load(da_rev_ptr + disc_seq + t, mask=tok_ok, other=0.0)) * \
            tl.load(trap_scale_ptr + disc_seq + t, mask=tok_ok, other=0.0)
        v_tok = tl.reshape(v_desc.load([b, t0, h * P + p0]), (C, BLOCK_P)).to(tl.float32)
        psiv_w = tl.reshape((v_tok[:, None, :] * psi[None, :, :]) * weight[:, None, None], (ROWS, BLOCK_P))
        psiv_w = psiv_w.to(DOT_DTYPE)
        decay = tl.exp(chunk_log_decay_at(da_cs_ptr + disc_seq, t0, S, C))
        state_lo = state_lo * decay + tl.dot(tl.trans(k_lo.to(DOT_DTYPE)), psiv_w, input_precision=DOT_PRECISION)
        state_hi = state_hi * decay + tl.dot(tl.trans(k_hi.to(DOT_DTYPE)), psiv_w, input_precision=DOT_PRECISION)

    end_state = seg_state_ptr + (bh * N_SEGMENTS + seg) * N * P
    end_ok = seg < N_SEGMENTS - 1
    tl.store(end_state + tile_offs, state_lo, mask=end_ok)
    tl.store(end_state + HALF * P + tile_offs, state_hi, mask=end_ok)


def tma_local_states(*, k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, trap_scale, states,
                     chunk_size, n_segments, chunks_per_segment, block_half, block_p, dot_dtype, dot_precision,
                     num_warps, num_stages=1, warp_specialize=False, **_unused):
    """``chunk_local_states`` (one chunk a step, fp32 rotation) through ``_tma_local_scan_kernel``; the same
    arguments (those it has no use for are ignored) plus the chunk loop's ``num_stages`` and ``warp_specialize``.
    Returns seg_state [B, H, n_segments, N, P] fp32 as chunk_local_states does."""
    B, S, R, G, N = k.shape
    H, P = v.shape[2], v.shape[3]
    RD = cos_angles.shape[3]
    C = chunk_size
    if C & (C - 1) or R & (R - 1) or C * R < 16 or P % block_p or (N // 2) % block_half:
        raise ValueError(f"tma_local_states: needs C, R powers of two with C * R >= 16, P % block_p == 0 and "
                         f"(N / 2) % block_half == 0; got C={C}, R={R}, P={P}, block_p={block_p}, N={N}, "
                         f"block_half={block_half}")
    seg_state = torch.empty((B, H, n_segments, N, P), device=k.device, dtype=torch.float32)
    grid = ((N // 2 // block_half) * (P // block_p), n_segments, B * H)
    _tma_local_scan_kernel[grid](
        k, v, cos_angles, sin_angles, k_bias, mimo_v, da_cs, da_cs_rev, trap_scale, seg_state, states,
        B, S, H, G, cdiv(S, C), chunks_per_segment, n_segments,
        C=C, R=R, N=N, P=P, RD=RD, BLOCK_HALF=block_half, BLOCK_P=block_p, DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision, NUM_STAGES=num_stages, WARP_SPECIALIZE=warp_specialize, num_warps=num_warps)
    return seg_state


def scan_arguments(inputs, *, n_segments, block_half, block_p, num_warps, dot_dtype, dot_precision,
                   rotation_math_dtype=tl.float32):
    """The state-scan arguments ``production_bwd_fwd`` builds for these inputs (one chunk a step; the rotation in
    ``rotation_math_dtype``, with tables in it where it is a half dtype, as where both stages rotate in it)."""
    activations = [inputs[name].dtype for name in ("q", "k", "v", "dout")]
    half = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}.get(rotation_math_dtype)
    gamma, trap_scale, cos_angles, sin_angles = token_tables(
        dt=inputs["dt"], trap=inputs["trap"], angles=inputs["angles"],
        rotation_dtype=half or rotation_table_dtype(*activations))
    nch = cdiv(inputs["k"].shape[1], inputs["chunk_size"])
    chunks_per_segment = cdiv(nch, n_segments)
    return dict(k=inputs["k"], v=inputs["v"], cos_angles=cos_angles, sin_angles=sin_angles, k_bias=inputs["k_bias"],
                mimo_v=inputs["mimo_v"], da_cs=inputs["da_cs"], da_cs_rev=inputs["da_cs_rev"], gamma=gamma,
                trap_scale=trap_scale, chunk_size=inputs["chunk_size"], n_segments=cdiv(nch, chunks_per_segment),
                chunks_per_segment=chunks_per_segment, block_half=block_half, block_p=block_p, dot_dtype=dot_dtype,
                dot_precision=dot_precision, num_warps=num_warps, max_registers=0, prefetch=False,
                skip_unrotated=False, rotation_math_dtype=rotation_math_dtype)


def states_pair(inputs, scan, variant):
    """(states, seg_state) of chunk_local_states and of the probe with ``variant`` = (num_stages, warp_specialize)."""
    k, v = inputs["k"], inputs["v"]
    B, S, _, _, N = k.shape
    H, P = v.shape[2], v.shape[3]
    shape = (B, H, cdiv(S, inputs["chunk_size"]), N, P)
    expected = torch.full(shape, float("nan"), device=k.device, dtype=k.dtype)
    got = torch.full(shape, float("nan"), device=k.device, dtype=k.dtype)
    expected_end = chunk_local_states(**scan, states=expected, span_chunks=1)
    got_end = tma_local_states(**scan, states=got, num_stages=variant[0], warp_specialize=variant[1])
    return (expected, expected_end), (got, got_end)


def max_relative_error(got, expected, n_segments):
    """max |got - expected| / max |expected| over the states and the end states that are written; inf where the
    probe left an element unwritten (the outputs start as NaN) or wrote a non-finite one."""
    (states, end), (want_states, want_end) = got, expected
    worst = 0.0
    for x, y in ((states, want_states), (end[:, :, :n_segments - 1], want_end[:, :, :n_segments - 1])):
        if not torch.isfinite(x).all():
            return float("inf")
        if x.numel():
            worst = max(worst, ((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30)).item())
    return worst


def check_small(device="cpu"):
    """{variant: max relative error} on a small fp32 shape with a tail chunk, two groups and two N/2 and P tiles
    (the interpreter on the CPU)."""
    inputs = make_inputs(B=1, S=100, H=4, G=2, N=64, P=32, R=2, chunk_size=8, dtype=torch.float32, seed=3,
                         device=device)
    scan = scan_arguments(inputs, n_segments=3, block_half=16, block_p=16, num_warps=4, dot_dtype=tl.float32,
                          dot_precision="ieee")
    errors = {}
    for variant in ((1, False), (2, True)):
        expected, got = states_pair(inputs, scan, variant)
        errors[variant] = max_relative_error(got, expected, scan["n_segments"])
    return errors


def loop_summary(kernel):
    """Resources of a compiled kernel, its chunk loop's SASS instruction count and the loop's loads, shared-memory
    traffic and barriers, and whether its PTX has a warp-specialized register split (``setmaxnreg``)."""
    import aot_report
    import sass_report

    loop = sass_report.largest_loop(sass_report.sass_ops(kernel)) or []
    opcodes = collections.Counter(op.split(".")[0] for op in loop)
    return dict(**aot_report.resources(kernel), loop=len(loop),
                **{op: opcodes[op] for op in ("LDG", "UTMALDG", "LDS", "STS", "BAR")},
                setmaxnreg=kernel.asm["ptx"].count("setmaxnreg"))


def compile_report(case):
    """Each variant on an official shape compiled for sm_90 (``loop_summary``), after the production scan that
    stores ``states`` there (the storing pass of two-pass shapes; with its register cap, where the probe has none)."""
    import aot_report
    from triton.compiler import ASTSource

    aot_report.compile_as_cuda()  # the production launches are captured from CPU tensors, as aot_report does
    shape = parse_case(case)
    config = choose_config(B=4, H=16, S=2048, num_sms=132, has_z=True, **shape)
    rows = []
    for name, args, kwargs in aot_report.official_launches(case):
        if name == "state_scan" and kwargs["STORE_STATES"]:
            rows.append(dict(case=case, kernel="production",
                             **loop_summary(aot_report.compile_launch(name, args, kwargs))))
    signature = {name: "*bf16" for name in ("k_ptr", "v_ptr", "states_ptr")}
    signature.update({name: "*fp16" for name in ("cos_ptr", "sin_ptr")})
    signature.update({name: "*fp32" for name in ("k_bias_ptr", "psi_ptr", "da_cs_ptr", "da_rev_ptr",
                                                 "trap_scale_ptr", "seg_state_ptr")})
    signature.update({name: "i32" for name in ("B", "S", "H", "G", "NCH", "CHUNKS_PER_SEG", "N_SEGMENTS")})
    for num_stages, warp_specialize in VARIANTS:
        constants = dict(C=shape["chunk_size"], R=shape["R"], N=shape["N"], P=shape["P"], RD=shape["N"] // 4,
                         BLOCK_HALF=config.block_half, BLOCK_P=config.block_p, DOT_DTYPE=tl.bfloat16,
                         DOT_PRECISION="ieee", NUM_STAGES=num_stages, WARP_SPECIALIZE=warp_specialize)
        source = ASTSource(_tma_local_scan_kernel, dict(signature, **{name: "constexpr" for name in constants}),
                           constexprs=constants)
        row = dict(case=case, kernel="probe", num_stages=num_stages, warp_specialize=warp_specialize)
        try:
            kernel = triton.compile(source, target=aot_report.TARGET, options=dict(num_warps=config.num_warps))
            rows.append(dict(row, **loop_summary(kernel)))
        except Exception as error:  # a variant Triton cannot compile is a finding, not a crash
            rows.append(dict(row, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"))
    return config, rows


def time_case(case, reps):
    """ms of chunk_local_states and of each probe variant on an official shape (bf16, dispatcher tiles), and
    each variant's max relative error against it."""
    shape = parse_case(case)
    config = choose_config(B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
                           has_z=True, **shape)
    inputs = make_inputs(B=4, S=2048, H=16, G=1, dtype=torch.bfloat16, device="cuda", seed=0, **shape)
    scan = scan_arguments(inputs, n_segments=config.n_segments, block_half=config.block_half,
                          block_p=config.block_p, num_warps=config.num_warps, dot_dtype=tl.bfloat16,
                          dot_precision="ieee")
    states = torch.empty((4, 16, cdiv(2048, shape["chunk_size"]), shape["N"], shape["P"]), device="cuda",
                         dtype=torch.bfloat16)
    record = dict(case=case, n_segments=scan["n_segments"], block_half=config.block_half, block_p=config.block_p,
                  num_warps=config.num_warps)
    record["production_ms"] = triton.testing.do_bench(
        lambda: chunk_local_states(**scan, states=states, span_chunks=1), rep=reps)
    for variant in VARIANTS:
        key = f"stages{variant[0]}{'_ws' if variant[1] else ''}"
        try:
            expected, got = states_pair(inputs, scan, variant)
            record[key + "_error"] = max_relative_error(got, expected, scan["n_segments"])
            record[key + "_ms"] = triton.testing.do_bench(
                lambda: tma_local_states(**scan, states=states, num_stages=variant[0], warp_specialize=variant[1]),
                rep=reps)
        except Exception as error:
            record[key + "_failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # N256: the two-pass storing scan's tiles (8 warps, one program an SM), where the pipelined probe compiles to
    # 194 registers without spill; the local-state shapes' tiles spill (N = 128) or lose residency (N = 64).
    parser.add_argument("--cases", nargs="+", default=["N256_P64_R4_C8", "N128_P64_R4_C16", "N64_P64_R4_C16"])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--small", action="store_true", help="the small-shape value check only")
    parser.add_argument("--reps", type=int, default=200, help="do_bench's rep (ms)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if args.small:
        print(check_small())
        return
    records = []
    if args.compile_only:
        for case in args.cases:
            config, rows = compile_report(case)
            print(f"{case}: dispatcher tiles [2 x {config.block_half}, {config.block_p}], {config.num_warps} warps")
            for row in rows:
                print("   ", row)
            records += rows
    else:
        # Descriptors made inside a kernel live in a global scratch the launcher allocates through this hook.
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, device="cuda", dtype=torch.int8))
        print("small-shape check on the GPU:", check_small("cuda"), flush=True)
        for case in args.cases:
            records.append(time_case(case, args.reps))
            print(records[-1], flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(records, out, indent=1)


if __name__ == "__main__":
    main()
