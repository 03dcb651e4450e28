"""The production bwd_fwd: state scans over sequence segments, then the chunk-parallel outputs.

Launches (docs/design.md): ``token_tables`` (gamma, trap_scale and cos / sin per token), then one of two
scan schedules that ``ScanConfig.local_states`` picks:

two passes:
1. ``segment_end_states``: each sequence segment's own end state (skipped with one segment);
2. ``chunk_states``: the state entering every chunk, written to ``states``;

local states (one scan pass):
1. ``chunk_local_states``: every segment from a zero state: segment-local ``states`` and end states;
2. ``segment_entry_states``: the state entering every segment, from the end states; the output
   stage adds each chunk's decayed entry state and writes ``states`` back;

then one of two output stages that ``ScanConfig.split_gate`` picks:

fused: ``chunk_output``: qk_dot, dz and the Phi / Zeta partials, one program per chunk group;
split: ``chunk_scan`` (raw_y of all ranks at once, and qk_dot) then ``gate_grads`` (dz and the
       Phi / Zeta partials, streaming over tokens);

and last ``sum_group_partials``: the Phi / Zeta gradients from the partials.

``choose_config`` is the shape dispatcher: it sizes the state tiles and the number of segments so
that the serial scans have enough programs to fill the GPU, picks the schedules, and the spans and
rank steps of the output stage.  Every config it picks covers the whole contract, so the choice is
about speed only; an explicit config a kernel cannot run is refused before any launch (chunk_scan's
32-wide P tile at N >= 128 on CUDA).
"""

import functools
import math
from dataclasses import dataclass

import torch
import triton.language as tl

from .chunk_output import chunk_output
from .chunk_scan import chunk_scan, chunk_scan_meta, refuse_miscompiled_tile
from .chunk_state import chunk_local_states, chunk_states, segment_end_states
from .gate_grads import gate_grads, gate_grads_meta
from .group_sum import sum_group_partials
from .host_utils import (cdiv, compiled_for_gpu, compiled_for_hopper, dependent_launch_supported, next_power_of_2,
                         precise_exp, rotation_math_dtype, rotation_source)
from .launch import dependent_launches, forbid_replay
from .span_decays import span_decays
from .state_passing import segment_entry_states
from .token_tables import token_tables

# Programs per SM the two-pass schedule's scans aim for (then rounded up to a power of two of segments), by
# N/2 tile, and the scan's warps.  The [2 x 64, 64] tiles run 8 warps (164 registers: one program an SM): sweeps
# of f57a6ee (2026-12-04_h200_sweep_f57a6ee_scan_warps.json, graph us), N256_P64_R4_C8 at 2 segments 829-830
# against 911-912 for the old 4 warps at 4 segments (state scans 467 -> 384).  The 32-wide tiles at 2 an SM:
# N128_P128_R4_C8 2 segments 855 against 882 at 4 (the fifth sweep where 2 led).  The 16-wide tiles too: without
# Z, N16_P64_R4_C8 (fused stage, two passes) at 4 segments 243 / 244 us in two sweeps of 8ebfff3, against 260 / 261
# at the old rule's 8 and 309 at 2.
TWO_PASS_SCAN = {64: (1, 8), 32: (2, 4), 16: (2, 4)}
# Scan programs one SM holds at once (4 warps, registers as compiled for sm_90 by benchmarks/aot_report.py),
# by N/2 tile, with fp32 rotation tables: [2 x 64, <= 64] state tiles 238-255 registers, 2; [2 x 32, <= 64]
# 144-168, 3; [2 x 16, 32] 85-100, 4.
RESIDENT_SCAN_PROGRAMS = {64: 2, 32: 3, 16: 4}
# With fp16 tables (bf16 activations, ``rotation_table_dtype``) the narrower tiles compile to 130-137 and 86-96
# registers; capped at 128 / 96 (24 B of spill at N64_P128, none elsewhere) they hold 4 / 5 programs an SM.
# N/2 tile -> (programs an SM, register cap of the scan).  Sweep of f67b954 (graph us, segments at the old ->
# the new count): N64_P64_R4_C16 387 -> 372 (3 -> 4, capped; scan 114 -> 101; 4 uncapped: 429), N64_P128_R4_C16
# 569 -> 546 (scan 151 -> 128; 4 uncapped: 634), N16_P64_R4_C8 309 -> 304 (4 -> 5; 6: 334), N32_P64_R4_C16
# 307 -> 304 (6: 336).  fp16 and fp32 activations keep the table above: at these caps they spill 8-56 B
# (fp16) and up to 992 B (fp32).
HALF_TABLE_SCAN_RESIDENCY = {64: (2, 0), 32: (4, 128), 16: (5, 96)}
# With fp16 tables a local-state scan over [2 x 32, 64] tiles loads a step ahead (``scan_prefetch``) at 2 programs
# an SM, uncapped (254 registers): N64_P128_R4_C16 539 / 540 us in two sweeps of f57a6ee against 561 / 562 for 4
# capped programs without it (state scan 140 -> 129).  The [2 x 32, 32] tile of N64_P64 loses with it (396 against
# 374): its capped scan fits 4 programs an SM, and loading ahead leaves room for 2.  (block_half, block_p) ->
# programs an SM.
PREFETCH_SCAN_RESIDENCY = {(32, 64): 2}
# With fp16 tables the 16-wide N/2 tile (N <= 32) scans all of P = 64 in one tile at 4 programs an SM (128 registers)
# instead of two 32-wide tiles at 5: half the programs a segment, so one wave holds 8 segments instead of 5 and each
# program walks 16 steps instead of 26 (the step time barely depends on the tile's width).  Sweep of a45a4ab
# (2026-12-06_h200_sweep_a45a4ab_small_scan_tile*.json, graph us, 32-wide tile at 5 segments -> 64-wide at 8):
# N16_P64_R4_C8 245.9 -> 228.9, N32_P64_R4_C16 241.6 -> 223.0; without Z 220.9 -> 204.4 (state scan 61.2 -> 43.3),
# 214.7 -> 197.2 (59.7 -> 40.0); at 10 segments and a 96 cap (5 an SM, 40 B of spill at N16) 233.2 / 226.5.
# (block_half, P tile) -> (programs an SM, register cap); P = 128 at N <= 32 is untimed and keeps the 32-wide tile.
WIDE_NARROW_SCAN_RESIDENCY = {(16, 64): (4, 128)}
# On once tests/test_kernels.py::test_official_wide_narrow_scan passed on the GPU (thirty-fourth session); the flag
# stays so the 32-wide tile can be timed against it (tests/test_bench.py runs the dispatcher both ways).
WIDE_NARROW_SCAN = True
# Fewest chunks a segment should hold: below that the fold and the extra pass cost more than they give.
MIN_CHUNKS_PER_SEGMENT = 4
# Gluon state scan programs an SM (gluon_state_scan.py: 8 hardware warps at 128 registers a thread).
GLUON_SCAN_PROGRAMS_PER_SM = 2
# The fused storing scan's programs an SM (gluon_scan_outputs.py: 8 hardware warps at 128 registers, ~90 KB of
# shared memory): its segments are as many as one wave of them holds, or, where that leaves segments of more chunks,
# one per SCAN_OUTPUTS_SEGMENT_CHUNKS.  H100, 368a96c, 64-wide P tile (graph us, one wave / 8 segments):
# N128_P64_R4_C16 303.1 / 322.6 (128 chunks: one wave is 4 segments of 32), R8_C8 611.1 / 577.4 (256 chunks),
# R2_C32 193.4 / 209.8 (64 chunks); optimization.md section 52.
SCAN_OUTPUTS_PROGRAMS_PER_SM = 2
SCAN_OUTPUTS_SEGMENT_CHUNKS = 32
# P where the dispatcher turns the fused storing scan on (N = 128, C * R = 64, with Z): 32 over one 32-wide tile
# (section 51), 64 over one 64-wide tile (section 52; tests/test_kernels.py::test_official_scan_outputs_64).
SCAN_OUTPUTS_P = (32, 64)
# P where it does so without Z as well, applying the gate itself (chunk_scan would apply it there): sections 53, 55;
# tests/test_kernels.py::test_official_scan_outputs_gate.
SCAN_OUTPUTS_WITHOUT_Z_P = (32, 64)
# P where it does so at N = 64 (both N/2 halves stacked in one 64-row state, section 55): with Z at P = 64 and over one
# 128-wide tile at P = 128; without Z (the gate in the pass) at P = 64 only.
# tests/test_kernels.py::test_official_scan_outputs_n64.
SCAN_OUTPUTS_N64_P = (64, 128)
SCAN_OUTPUTS_N64_WITHOUT_Z_P = (64,)
# The Gluon state scan's widest P tile (a 128-byte bf16 box row).
GLUON_SCAN_MAX_BLOCK_P = 64
# Chunks the Gluon end-state pass takes a step where the fused storing scan runs at an (N, P) of
# SCAN_OUTPUTS_END_SPAN_SHAPES (``end_span_chunks``, on the spans' decay tables; ``_end_pass_scan`` keeps one chunk
# where the longer one does not fit): sections 56-57.  H100, b23e265 (2026-12-07_h100_sweep_b23e265_end_span.json,
# graph us, span 1 -> 2): N64_P128 426.5 -> 417.8 (official grid at db62bd5: 418.4, eager 424.8 against 97dfb00's
# 424.9 / 430.3); N64_P64 243.6 -> 241.9 with Z but its eager calls 2-3% slower, without Z 192.5 -> 191.7 graph and
# 194.4 -> 240.5 eager (replayed all the same, section 58: the host's time a call); at N = 128 (one ring stage of the
# longer chunk left) N128_P64_R4_C16 292.5 -> 293.4, N128_P32 228.2 -> 231.8, R8_C8 578.6 -> 577.2.
SCAN_OUTPUTS_END_SPAN = 2
SCAN_OUTPUTS_END_SPAN_SHAPES = ((64, 128),)
# The fused pass's intra-chunk weights once a (row, column token) (``scan_outputs_token_weights``, sections 58,
# 60): timed to win where the rule below takes it, GPU-tested at the dispatcher's forms (test_gluon_scan_outputs.py);
# off until the official-grid tests run with it (PART=official SCAN_TW=True bash benchmarks/token_weights_gpu.sh).
SCAN_OUTPUTS_TOKEN_WEIGHTS = False
# The same view in chunk_scan (``out_token_weights``, section 59), taken without Z only (the rule below).
OUT_TOKEN_WEIGHTS = True
# (token, rank) rows a span of chunks should fill in the output stage and the end-state scan.
SPAN_ROWS = 64
# chunk_scan over single short chunks: where a chunk is at most SMALL_CHUNK_ROWS (token, rank) rows and the state's
# N/2 tile 16 wide (N <= 32), each chunk_scan program takes one chunk (not a span of SPAN_ROWS) at
# SMALL_CHUNK_SCAN = (warps, register cap): more, smaller programs in flight per SM for a kernel held by latency
# (section 43).  H100, a364ee9, graph us, N16_P64_R4_C8 (a span of 2 chunks at 4 warps, 128 cap -> one chunk at 2
# warps, 96 cap): with Z 236.2 -> 220.0 (chunk_scan 111.4 -> 95.9), without Z 203.2 -> 159.3 (the gated chunk_scan
# 139.2 -> 91.1); one chunk at 4 warps and a 64 cap 223.6 / 167.2.  At large N it loses: N256_P64_R4_C8 693 -> 1005,
# N128_P128_R4_C8 695 -> 782 (one chunk, 4 warps, 128 cap); 64-row chunks at 2 warps lose too (N32 234 -> 288).
SMALL_CHUNK_ROWS = 32
SMALL_CHUNK_SCAN = (2, 96)
# (token, rank) rows of the largest chunk the kernels take (next_pow2(C) * next_pow2(R), the official grid's): the
# output stage's score tile is [rows, rows].  Larger chunks are walked as inner chunks (``inner_chunk_size``).
MAX_KERNEL_ROWS = 64
# The knobs the sweeps of 01845e8 chose (docs/optimization.md sections 30-31): d_in_gate on the split shapes with
# P <= 64; the bf16 rotation with chunk_scan's low-register order and its 128-register cap on the local-state shapes;
# and gluon_scan, the state scans as the warp-specialized Gluon kernel where it applies (section 33).  Timed on the
# H200 (the first group: Z on -8% graph geomean) and on an H100 (gluon_scan: -8 to -13% a case); on since the GPU test
# grids passed with them on an H100 (section 33).  False gives the earlier defaults (test_dispatcher_swept_knobs).
DISPATCH_SWEPT_KNOBS = True


def _check_tile(name, value):
    if value < 16 or value & (value - 1):
        raise ValueError(f"ScanConfig.{name} must be a power of two >= 16 (tl.dot), got {value}")


@dataclass(frozen=True)
class ScanConfig:
    """Launch shape of the production path.

    block_p / block_half: P tile and N/2 tile of one state-scan program;
    n_segments: sequence segments scanned in parallel;
    out_block_p: P tile of the output stage; chunks_per_program: spans (of out_span_chunks chunks) one
    output program walks;
    num_warps / out_num_warps: warps of the scan and of the output programs;
    ranks_per_step: query ranks the output stage takes per serial step (1: one rank at a time);
    out_span_chunks / end_span_chunks: chunks the output stage / the segment end-state scan take as
    one unit (the outputs and the end states do not depend on where chunks are cut; ``states``
    does, so the scan that writes it steps one chunk at a time).  The Gluon end-state pass before the fused
    storing scan (``scan_outputs``) takes a span as one chunk of end_span_chunks * C tokens, on the spans' own
    decay tables (``span_decays``; the other Gluon passes step one chunk at a time);
    local_states: one scan pass writes segment-local states and end states, a fold gives each
    segment its entry state and the output stage adds it (``chunk_local_states``,
    ``segment_entry_states``), instead of an end-state pass and a second scan that folds first
    (``segment_end_states``, ``chunk_states``).  Same outputs; ``end_span_chunks`` is then unused.
    split_gate: the output stage in two passes, ``chunk_scan`` (raw_y of all ranks at once, stored)
    then ``gate_grads`` (the gate gradients, streaming over tokens), instead of the fused
    ``chunk_output``; out_block_p / out_num_warps / out_span_chunks / chunks_per_program then shape
    ``chunk_scan`` (whose programs walk their spans unrolled), and ranks_per_step is unused.
    out_max_registers: register cap per thread of ``chunk_scan`` (0: the compiler's choice); 168 fits
    three 4-warp programs per SM instead of two.
    gate_tokens: tokens one ``gate_grads`` program walks (split_gate only).
    state_span_chunks: chunks the scan that stores ``states`` (``chunk_states`` or ``chunk_local_states``)
    loads per step, storing the state entering each (1: one chunk a step).
    scan_max_registers: register cap per thread of the state scans (0: the compiler's choice); at 168 an SM
    holds three 4-warp scan programs instead of two where the compiler takes 255 (the 64-wide tiles).  The Gluon
    scan launches at 128 and takes a cap only below that (80: three programs an SM, 64: four).
    scan_prefetch: the state scans issue each step's loads one step ahead (held in registers across the
    step's products), so their latency hides under the previous step's work.
    end_scan_prefetch: the same for the end-state pass of the two-pass schedule alone (``segment_end_states``).
    Where that pass has few programs (N256, N128_P128 at two segments: 128 / 256, one or two an SM) its extra
    registers cost no residency, while in the storing pass they do (section 22: prefetch in both passes, N256
    829 -> 979 us); untimed, off by default (docs/optimization.md section 31).
    scan_skip_unrotated: state-scan programs whose N/2 tile lies wholly past the rotary dims (n >= RD = N/4 in
    each half: the upper tiles where block_half <= RD, e.g. N = 256 at 64, N = 128 at 32) branch around the
    rotation math.  Statically 12-18% of the loop's SASS is skipped for those programs (docs/optimization.md
    section 27); untimed, off by default.  An earlier branch of this kind (separate rotated and plain loads) was
    timed and lost everywhere (section 19: N256 state scan 471 -> 560 us).
    gate_in_scan: with split_gate, ``chunk_scan`` applies the gate to its raw_y tile in registers (dz and
    per-span dPhi / dZeta partials) instead of storing raw_y for ``gate_grads`` (the dispatcher's choice without
    Z, and with Z at R = 1 and in the single-chunk chunk_scan of ``SMALL_CHUNK_SCAN``).
    half_raw_y: with split_gate and bf16 activations, the raw_y scratch between ``chunk_scan`` and
    ``gate_grads`` is fp16 with a power-of-two scale per row (half the bytes of fp32 each way, 2^-12
    relative; ``raw_y_scratch_dtype``); other activations, or False, keep it fp32.
    d_in_gate: with split_gate and D, the D skip joins the gate's fp32 math (``gate_grads`` reads v again; with
    gate_in_scan, ``chunk_scan``'s gate epilogue adds it from v and Psi) and ``chunk_scan``'s products leave it out,
    instead of ``chunk_scan`` adding it after its products from v and Psi read again (volatile loads on its path to
    the raw_y store).  Sweeps of 6309ed2 and c08c5c8 with Z (gate_grads' form; graph us, off -> on):
    N128_P64_R4_C16 420 -> 407, R8_C8 823 -> 803, N128_P32 391 -> 367, N16 267 -> 263, N64_P128 465 -> 464
    (chunk_scan -11 to -35 us, gate_grads +7 to +19); with ``DISPATCH_SWEPT_KNOBS`` the dispatcher sets it on the
    split shapes with P <= 64, with and without Z (sweeps of 01845e8: docs/optimization.md sections 30-31).
    flat_tables: ``token_tables`` indexes its tables flat (contiguous loads and stores of angles whatever RD and H
    are) instead of per (b, h) and token block (docs/optimization.md section 27); with ``DISPATCH_SWEPT_KNOBS`` the
    dispatcher sets it (timed in section 44: token_tables -3 to -9 us a call).
    out_q_cast_early / out_y_state_early: ``chunk_scan`` (both forms) narrows q~ to the dot dtype before k is
    loaded / forms q~ @ state right after the scores: the same arithmetic in an order with fewer live registers.
    Statically (``benchmarks/aot_report.py``) at N = 128 with Z both together compile to 0-56 B of spill at a
    128-register cap (96-208 B in the default order), which lets four chunk_scan programs share an SM instead
    of three (docs/optimization.md section 28); with ``DISPATCH_SWEPT_KNOBS`` the dispatcher sets both with the half
    rotation below (section 30).
    out_defer_state_store / out_defer_qk_dot: ``chunk_scan`` writes each span's full entering state (with local
    states) after q~ @ state instead of right after the state and entry loads / qk_dot after the products instead of
    right after the scores.  A store is where the compiler stops moving loads up (they might alias), and it waits for
    its data: in N128_P64_R4_C16's SASS the state / entry loads, then the state stores, then q's loads, then k's
    (section 44).  With ``DISPATCH_SWEPT_KNOBS`` the dispatcher defers the state store at N64_P64 and qk_dot at
    N128_P128, where each was timed to win (section 45; qk_dot without Z since section 46).
    out_token_weights: ``chunk_scan`` computes the intra-chunk weights once a (row, column token), on the scores
    viewed as [rows, tokens, ranks], instead of once a score (``scan_outputs_token_weights``'s view in chunk_scan).
    out_early_mixing: ``chunk_scan`` weighs the scores right after building the weights, before v and Psi are loaded
    (statically R1_C64 without Z: 160 -> 128 B of spill, N16 without Z 8 -> 0; section 59).  The dispatcher takes
    the token weights without Z at R > 1 and early mixing without Z at R = 1, where each was timed to win.
    scan_half_rotation / out_half_rotation: where the products take 16-bit operands, k's bias add and rotation in the
    state scans / q's and k's in the output stage (``chunk_scan`` or ``chunk_output``) run in that dtype, two elements
    a register, instead of in fp32 rounded once before the products; the rotated columns take up to three roundings
    instead of one.  With both on the cos / sin tables are written in that dtype, else they keep
    ``rotation_table_dtype`` and the 16-bit stages convert them.  Statically (bf16) the state scan's step loses 16% of
    its SASS with converted tables and 25% with bf16 ones (N128_P64_R4_C16 1040 -> 873 / 776), chunk_scan 16% (2752 ->
    2304) and 38 registers uncapped at N = 128 (180 -> 142), and N256's chunk_scan its 112 B of spill
    (docs/optimization.md section 29).  With ``DISPATCH_SWEPT_KNOBS`` the dispatcher sets both on the local-state
    shapes with bf16 products, except where the scan loads ahead (section 30: N128_P64_R4_C16 409 -> 373 us with the
    order and cap above).
    gate_tile_elements / gate_num_warps: elements of one ``gate_grads`` tile and warps of its programs (1024, or 4096
    at 8 warps, lose to 2048 at 4 in the sweep of f4a1969: docs/optimization.md section 26).
    gluon_scan: the state scans (whichever schedule) run as the warp-specialized Gluon kernel of
    ``gluon_state_scan.py`` (a TMA producer warp, a wgmma consumer warpgroup; one chunk a step, its own N/2 tile
    of 64 and ring depth) where it applies (``gluon_state_scan.unsupported``: a Hopper GPU, bf16 k and states, N = 64
    or a multiple of 128, a P tile of 32 or 64, ...), else the Triton scans.  Its launches replay with the rest of the
    call (``launch.py`` rebuilds their host tensor descriptors).  GPU-tested and timed on an H100 (whole calls -8
    to -13% on five N = 128 / 256 official shapes) and on the H200 (N = 64: N64_P128 468 -> 427 us);
    ``DISPATCH_SWEPT_KNOBS`` sets it (docs/optimization.md sections 33-34).
    gluon_gate: ``gate_grads`` runs as the Gluon kernel of ``gluon_gate_grads.py`` (its tiles brought in by TMA through
    a ring of shared-memory stages, ranks and columns across a warp's lanes) where it applies
    (``gluon_gate_grads.unsupported``: a Hopper GPU, the fp16 raw_y scratch, 16-bit activations, R a power of two up
    to 8, ...), else the Triton kernel (docs/optimization.md section 37).
    gluon_segments: the two-pass schedule's segment count where the Gluon scan runs it (0: n_segments).  Its storing
    pass is held by the memory, so one program an SM walking every chunk stores as fast as two an SM, and one segment
    needs no end-state pass; the Triton scans, which need programs in flight to hide their loads, keep n_segments
    (docs/optimization.md section 39).  With ``DISPATCH_SWEPT_KNOBS`` the dispatcher sets 1 on the two-pass shapes
    (H100: N256 767 -> 695 us, N128_P128 778 -> 697; section 40).
    pdl: every kernel of the call with programmatic dependent launch (``launch.dependent_launches``; Hopper GPUs,
    inert elsewhere): a kernel's programs are scheduled while the previous kernel's
    last ones finish, ask for what they can (inputs, tables written further back) and wait for it before reading its
    output, which was to take the launch gap and the programs' start off each of the call's kernel boundaries.  Off:
    on an H100 it moved calls -3% to +8% (a loss at N >= 128; docs/optimization.md section 40).
    fold_one_scan: with local states, the segment fold (``segment_entry_states``) takes every segment's end state at
    once and runs one associative scan over the segments, instead of a serial walk that waits on a load and a store a
    segment (4 us at two segments, 15-20 at four, 36-50 at eight on the H200's N = 64 shapes).  With
    ``DISPATCH_SWEPT_KNOBS`` the dispatcher sets it with local states (H100: -0 to -4 us a call; section 40).
    angles_in_kernels: with split_gate and 16-bit cos / sin tables (``rotation_table_dtype``), ``chunk_scan`` and the
    Gluon scan compute the tables' values from the angles themselves (``triton_utils.table_cos_sin``: the same numbers),
    and ``token_tables`` writes the cos / sin tables only where a Triton scan still reads them.  Where both take the
    angles, the call neither writes nor reads the tables: 8 bytes fewer an angle (docs/optimization.md section 50).
    scan_outputs: with split_gate (raw_y stored, not gate_in_scan) and the Gluon scan, the call runs two passes and
    its storing pass forms raw_y and qk_dot itself while each entering state is on chip (``gluon_scan_outputs``, where
    it covers the call: N = 64 or 128, C * R = 64, ...): chunk_scan is not launched and ``states`` is not read back; the
    D skip joins ``gate_grads``.  Its segments are ``gluon_segments``, or (0) as many as fill
    ``SCAN_OUTPUTS_PROGRAMS_PER_SM`` programs an SM (docs/optimization.md section 51).
    scan_outputs_block_p: that kernel's P tile, 32, 64 or 128 (N = 64 without the gate) (0: the widest that divides P
    and fits, ``gluon_scan_outputs.plan``; at 64 and N = 128 q is rotated in place, section 52).
    scan_outputs_ring_weights: that kernel's producer copies each chunk's da_rev and trap_scale into the ring beside
    its tiles (as the Gluon scan's ``ring_weights``), where the consumer loaded them itself (section 53; the
    dispatcher's at chunks of 16 tokens or more, section 55).
    scan_outputs_weights_ahead: that kernel loads each chunk's log decays (and, without the ring, its da_rev and
    trap_scale) a step ahead, so their exps do not wait out the L2 latency (section 58; the dispatcher's at N = 128
    with 16-token chunks, where the registers they hold add no spill that costs more).
    scan_outputs_token_weights: that kernel computes the intra-chunk weights once a (row, column token) over the
    scores viewed as [rows, R, C], broadcast over the column ranks, not once a score (section 58).
    scan_outputs_gate: that kernel also applies the gate to each chunk's raw_y while it is in registers (dz, and the
    dPhi / dZeta partials of its segment, with the D skip in fp32), so no raw_y scratch goes out and back and
    ``gate_grads`` is not launched (where the kernel covers the gate: 16-bit dout / z; section 54).  The dispatcher's
    without Z only (section 55).
    scan_outputs_d_skip: without the gate in it, that kernel adds the D skip to raw_y in fp32 before storing it, so
    ``gate_grads`` adds none (at P = 128, where gate_grads with the skip costs more; section 55).
    """

    block_p: int
    n_segments: int
    block_half: int = 32
    out_block_p: int = 64
    chunks_per_program: int = 1
    num_warps: int = 4
    out_num_warps: int = 8
    ranks_per_step: int = 1
    out_span_chunks: int = 1
    end_span_chunks: int = 1
    local_states: bool = False
    split_gate: bool = False
    out_max_registers: int = 0
    gate_tokens: int = 64
    state_span_chunks: int = 1
    gate_in_scan: bool = False
    scan_max_registers: int = 0
    scan_prefetch: bool = False
    end_scan_prefetch: bool = False
    scan_skip_unrotated: bool = False
    flat_tables: bool = False
    half_raw_y: bool = True
    d_in_gate: bool = False
    out_q_cast_early: bool = False
    out_y_state_early: bool = False
    out_defer_state_store: bool = False
    out_defer_qk_dot: bool = False
    out_token_weights: bool = False
    out_early_mixing: bool = False
    scan_half_rotation: bool = False
    out_half_rotation: bool = False
    gate_tile_elements: int = 2048
    gate_num_warps: int = 4
    gluon_scan: bool = False
    gluon_gate: bool = False
    gluon_segments: int = 0
    pdl: bool = False
    fold_one_scan: bool = False
    angles_in_kernels: bool = False
    scan_outputs: bool = False
    scan_outputs_block_p: int = 0
    scan_outputs_ring_weights: bool = False
    scan_outputs_weights_ahead: bool = False
    scan_outputs_token_weights: bool = False
    scan_outputs_gate: bool = False
    scan_outputs_d_skip: bool = False

    def __post_init__(self):
        for name in ("block_p", "block_half", "out_block_p"):
            _check_tile(name, getattr(self, name))
        if self.n_segments < 1:
            raise ValueError(f"ScanConfig.n_segments must be >= 1, got {self.n_segments}")
        if self.scan_outputs_block_p not in (0, 32, 64, 128):
            raise ValueError(f"ScanConfig.scan_outputs_block_p must be 0, 32, 64 or 128, got "
                             f"{self.scan_outputs_block_p}")
        if self.gluon_segments < 0:
            raise ValueError(f"ScanConfig.gluon_segments must be >= 0, got {self.gluon_segments}")
        for name in ("ranks_per_step", "out_span_chunks", "end_span_chunks", "state_span_chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"ScanConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("out_max_registers", "scan_max_registers"):
            if getattr(self, name) and not 24 <= getattr(self, name) <= 255:
                raise ValueError(f"ScanConfig.{name} must be 0 or in 24..255, got {getattr(self, name)}")
        if self.gate_tile_elements < 1 or self.gate_tile_elements & (self.gate_tile_elements - 1):
            raise ValueError(f"ScanConfig.gate_tile_elements must be a power of two, got {self.gate_tile_elements}")
        if self.gate_tokens < 1:
            raise ValueError(f"ScanConfig.gate_tokens must be >= 1, got {self.gate_tokens}")
        if self.chunks_per_program < 1:
            raise ValueError(f"ScanConfig.chunks_per_program must be >= 1, got {self.chunks_per_program}")
        for name in ("num_warps", "out_num_warps", "gate_num_warps"):
            if getattr(self, name) not in (1, 2, 4, 8, 16):
                raise ValueError(f"ScanConfig.{name} must be a power of two <= 16, got {getattr(self, name)}")


# Cached: a call's host work is several times the device time on small problems (benchmarks/host_profile.py).
@functools.lru_cache(maxsize=256)
def choose_config(*, B, H, S, N, P, R, chunk_size, num_sms, split_gate=None, has_z=True, half_tables=True,
                  swept_knobs=None, hopper=True):
    """Pick tiles, segments and chunk groups for one problem (see docs/optimization.md).

    ``split_gate``: force the split (True) or the fused (False) output stage, with the settings that go
    with it; None: the dispatcher's rule.  ``has_z``: whether the call has the SiLU gate (z).
    ``half_tables``: the rotation tables are fp16 (``rotation_table_dtype``: bf16 activations, as on the
    official grid), which leaves the state scans fewer registers and room for more programs an SM.
    ``swept_knobs``: take the knobs of ``DISPATCH_SWEPT_KNOBS`` (True), leave them off (False), or follow that
    constant (None).  ``hopper``: the Gluon kernels can run (False: rules that pay only through one of them and cost
    the Triton path that replaces it are not taken).  The config is for the chunk the kernels walk:
    ``inner_chunk_size(chunk_size, R)``.
    """
    chunk_size = inner_chunk_size(chunk_size, R)
    nch = cdiv(S, chunk_size)
    p_pow = max(16, next_power_of_2(P))
    half_pow = max(16, next_power_of_2(N // 2))
    # Measured on the H200 (benchmarks/results/2026-12-03_h200_sweep_723dec1.json): a 64-wide P
    # tile wins at N = 128 (702 vs 806 us), 32 at N = 16; 4 output warps win at N = 16 (497 vs
    # 648 us), 8 at N = 128 (806 vs 839 us).
    # Sweep of 9ed3b5f (2026-12-03_h200_sweep_9ed3b5f.json): at N = 128 a 64-wide N/2 tile wins
    # again (N128_P64_R4_C16 640 vs 706 us, N128_P64_R8_C8 1576 vs 1700).
    block_p = min(p_pow, 64 if N >= 128 else 32)
    block_half = min(half_pow, 64 if N >= 128 else 32)
    if p_pow >= 128 and N in (64, 128):
        # Sweep of a0ddfb0 (graph us, split output stage): N64_P128_R4_C16 620 -> 563 with a 64-wide P tile
        # (state scan 239 -> 177 us); N128_P128_R4_C8 922 -> 874 with a 32-wide N/2 tile (4 tiles of 168
        # registers, 3 programs per SM, instead of 2 of 255).
        block_p, block_half = 64, 32
    tiles = cdiv(half_pow, block_half) * cdiv(p_pow, block_p)
    per_sm, num_warps = TWO_PASS_SCAN[block_half]
    # Short chunks (C * R < SPAN_ROWS) are read in spans of SPAN_ROWS (token, rank) rows by the stages
    # that do not write per-chunk states: fewer, fuller serial steps (the C = 8 shapes).
    # Sweep of 0ab35d8 (2026-12-03_h200_sweep_0ab35d8.json, graph us): spans of 2 chunks of 8 cut
    # N16_P64_R4_C8 494 -> 359, N256_P64_R4_C8 1812 -> 1296, N128_P128_R4_C8 1746 -> 1257; spans of
    # 128 rows lose (N128_P64_R4_C16 621 -> 753, N128_P64_R8_C8 1542 -> 1472 only); the end-state scan
    # gains ~1% from spans of 64 rows and spills at 128.
    span_chunks = 1
    while 2 * span_chunks * chunk_size * next_power_of_2(R) <= SPAN_ROWS and 2 * span_chunks <= nch:
        span_chunks *= 2
    # A query tile shorter than 16 tokens (tl.dot pads it to 16 rows) takes two ranks per step instead:
    # N128_P64_R8_C8 1542 -> 1317 us; on full tiles more ranks per step spill (N128_P64_R4_C16 621 -> 861).
    ranks_per_step = max(1, min(R, 16 // (chunk_size * span_chunks)))
    want_segments = next_power_of_2(cdiv(per_sm * num_sms, B * H * tiles))
    # One scan pass writing segment-local states, the output stage adding the segment entry states
    # (``local_states``), where the output kernel has the registers for it: one chunk per output
    # step, one query rank per step, 32 <= N <= 128.  Graph us, two passes -> local states at 4
    # segments; sweep of c16a25d (two passes at the segments chosen then): N64_P64_R4_C16 497 -> 452,
    # N128_P64_R4_C16 624 -> 569, N64_P128_R4_C16 854 -> 780, N128_P64_R1_C64 295 -> 271; sweep of
    # 98f87f0 (two passes at 4 segments): N32_P64_R4_C16 381 -> 349, N128_P32_R4_C16 544 -> 490,
    # N128_P64_R2_C32 404 -> 394.  It loses where the output kernel is short of registers: spans of
    # chunks (N16_P64_R4_C8 356 -> 364 at best, N256_P64_R4_C8 1077 -> 1092, N128_P128_R4_C8
    # 1107 -> 1125 at best: spills) and two ranks per step (N128_P64_R8_C8 1308 -> 1724: 168 output
    # registers instead of 128).  Its segment count is set below.
    local_states = span_chunks == 1 and ranks_per_step == 1 and 32 <= N <= 128
    scan_max_registers = 0
    scan_prefetch = False
    # The split output stage (chunk_scan + gate_grads, docs/optimization.md sections 15-16) everywhere: with
    # gate_grads over token ranges it won on all 11 official shapes (sweep of 1de1006, graph us, fused ->
    # split): N16_P64_R4_C8 331 -> 317, N32 316 -> 288, N64_P64 435 -> 400, N128_P64_R4_C16 546 -> 407,
    # N256 1077 -> 901, N64_P128 727 -> 620, N128_P32 482 -> 343, N128_P128 1056 -> 918, R8_C8 1279 -> 837,
    # R2_C32 365 -> 238, R1_C64 238 -> 172.  Without Z there is no sigmoid for gate_grads to save, and the
    # fused stage stays faster on the small shapes (graph us, fused at 932c232 -> split at ba767ee, same fused
    # kernel and config without Z): N16 255 -> 297, N32 239 -> 265, N64_P64 365 -> 380; P = 128 and N = 128
    # keep the split stage (N64_P128 610 -> 506, N128_P32 421 -> 318, N128_P64_R4_C16 407 -> 385).  With
    # chunk_scan at 128 registers N = 64 joins them (sweep of f51bf7f without Z, fused -> gate in chunk_scan:
    # N64_P64_R4_C16 293 -> 281; N32 219 -> 219).  With the bf16 rotation, chunk_scan's low-register order and its
    # 128 cap the split stage (gate in chunk_scan, local states) took the last two as well (H100, 2c5662a,
    # 2026-12-05_h100_sweep_2c5662a_noz_small_split.json, graph us, fused -> split): N16_P64_R4_C8 244 -> 225
    # (chunk_scan 140 us against chunk_output 114, the scan 60 against two passes' 114), N32 218 -> 218.  So the
    # split stage everywhere; the fused one stays for explicit configs (N < 16 without Z was never timed).
    if split_gate is None:
        split_gate = True
    out_block_p = min(p_pow, 64)
    # 8 output warps only at N = 128 with P <= 64 (N128_P64_R4_C16 618 vs 689 us with 4); elsewhere 4:
    # sweep of 8ee521e (2026-12-03_h200_sweep_8ee521e.json, graph us, a since-reverted kernel variant):
    # N256_P64_R4_C8 1246 -> 1135, N64_P64_R4_C16 522 -> 512; with the kept kernel the official grid
    # of 9eaf180 against c788de8: N256 1293 -> 1096, N64_P64 543 -> 500.  N16 had 4 already (497 vs 648
    # at 723dec1).
    out_num_warps = 8 if N == 128 else 4
    if p_pow >= 128 and N <= 128:
        # Sweep of e7a811a (2026-12-03_h200_sweep_e7a811a.json, graph us): one 4-warp program over 128
        # columns does the P-independent work (k~, scores, weights) once: N64_P128_R4_C16 949 -> 843,
        # N128_P128_R4_C8 1247 -> 1117 (255 registers, no spill; 8 and 16 warps lose).
        out_block_p, out_num_warps = 128, 4
    if split_gate:
        # chunk_scan's P tile: narrower ones miscompile at N/2 >= 64, and a 16-wide one at N = 64, R = 4 (an illegal
        # address on the H100, section 45; P = 16 took it).
        out_block_p = max(out_block_p, 64 if half_pow >= 64 else 32)
        # Local states where chunk_scan's [N, P tile] state is at most 128 x 64 (sweep of 1de1006, graph us,
        # two passes -> local): N128_P64_R4_C16 455 -> 407, R8_C8 917 -> 837, N64_P128 697 -> 620 (64 x 128),
        # N16 335 -> 317.  Beyond it the entry correction of a span of chunks costs chunk_scan more than the
        # second scan pass: N256_P64_R4_C8 901 -> 986 (chunk_scan 333 -> 566), N128_P128_R4_C8 918 -> 1060.
        local_states = N * out_block_p <= 128 * 64
    if local_states:
        # The single pass wants one wave of scan programs: every program resident from the start, as many
        # segments as fill the SMs' slots and no more (a partial second wave doubles the serial chain of the
        # SMs it lands on).  Sweeps of 4b8eeb1 (2026-12-04_h200_sweep_4b8eeb1*.json, graph us, 4 -> 3 segments
        # where the 168-register scan holds 3 programs an SM): N64_P64_R4_C16 434 -> 398 (scan 153 -> 110),
        # N64_P128_R4_C16 622 -> 565; without Z 356 -> 309, 468 -> 419.  Where 4 segments are one wave (N16,
        # N32, the N = 128 shapes) 5, 6 or 8 lose or tie (N32 310 -> 342 / 334 / 321).
        # The register caps of HALF_TABLE_SCAN_RESIDENCY put 4 / 5 narrow scan programs on an SM (sweep of f67b954).
        num_warps = 4
        per_sm = RESIDENT_SCAN_PROGRAMS.get(block_half, 2)
        if half_tables:
            per_sm, scan_max_registers = HALF_TABLE_SCAN_RESIDENCY.get(block_half, (per_sm, 0))
            if WIDE_NARROW_SCAN and (block_half, p_pow) in WIDE_NARROW_SCAN_RESIDENCY:
                block_p = p_pow
                tiles = cdiv(half_pow, block_half) * cdiv(p_pow, block_p)
                per_sm, scan_max_registers = WIDE_NARROW_SCAN_RESIDENCY[block_half, p_pow]
            if (block_half, block_p) in PREFETCH_SCAN_RESIDENCY:
                per_sm, scan_max_registers = PREFETCH_SCAN_RESIDENCY[block_half, block_p], 0
                scan_prefetch = True
        want_segments = max(1, per_sm * num_sms // (B * H * tiles))
    # The scan that stores ``states`` takes a span of short chunks a step where its state tile is narrow (N <= 64):
    # sweep of 5f4cfc7 (2026-12-04_h200_sweep_5f4cfc7.json, graph us, 1 -> 2 chunks a step): N16_P64_R4_C8
    # 323 -> 297 (state scan 98 -> 73; 4 chunks: 344); 128-row steps lose or tie (N32_P64_R4_C16 290 -> 324,
    # N64_P64_R4_C16 403 -> 400) and a [2 x 64, 64] tile loses (N128_P64_R4_C16 411 -> 595, state scan 122 -> 304).
    # Two chunks at most: the only count timed to win (four spans' products each cover the whole span's rows).
    state_span_chunks = min(span_chunks, 2) if N <= 64 else 1
    out_span_chunks = span_chunks
    swept = DISPATCH_SWEPT_KNOBS if swept_knobs is None else swept_knobs
    if swept and local_states and N == 64:
        # The Gluon scan (gluon_scan, below) at N = 64: one wave of its programs (two an SM, a [64, P tile] state
        # each), fewer segments than the Triton scan's residency asks for, and so less fix-up for chunk_scan and
        # segment_entry.  Sweep of 92ae56c (2026-12-05_h200_sweep_92ae56c_n64.json, graph us, Gluon scan at 4 -> 2
        # segments): N64_P64_R4_C16 320 -> 299 (chunk_scan 144 -> 138, segment_entry 15 -> 3, scan 81 -> 79);
        # N64_P128_R4_C16 is at 2 already (427; 1 segment 459, 4 455).  Not timed at N >= 128 (N128_P32 would go
        # from 4 to 2).  Where the Gluon scan does not apply (off Hopper) the Triton scan runs at this count.
        # Its P tile is 64 wide (its widest box) where P allows: each program rotates a chunk's k once for 64
        # columns, not once for each of two 32-wide tiles, and one wave holds twice the segments at half the steps.
        # H100, 9432861 (sweep_prepared.sh part 34, graph us, 32-wide at 2 segments -> 64-wide at 4):
        # N64_P64_R4_C16 297.4 -> 273.9 with Z (scan 79 -> 49, chunk_scan 139 -> 144), 263.0 -> 238.5 without; at 2
        # / 3 / 6 segments 284.5 / 281.5 / 297.3.  Three or four 32-wide programs an SM (register caps 80 / 64) gave
        # at best 288.5 (4 segments, cap 64).
        block_p = min(p_pow, GLUON_SCAN_MAX_BLOCK_P)
        want_segments = max(1, GLUON_SCAN_PROGRAMS_PER_SM * num_sms // (B * H * cdiv(P, block_p)))
    n_segments = max(1, min(want_segments, nch // MIN_CHUNKS_PER_SEGMENT))
    # One chunk per output program: walking several keeps the loop's tiles live and took the kernel
    # from 128 to 234 registers (1 CTA per SM instead of 2); the partials it saves are small.
    chunks_per_program = 1
    out_max_registers = 0
    gate_tokens = ScanConfig.gate_tokens
    # chunk_scan applies the gate itself (no raw_y scratch, no gate_grads launch) without Z, and with Z at R = 1.
    # Sweep of 176994b with Z (2026-12-04_h200_sweep_176994b.json, graph us, split -> gate in chunk_scan):
    # N128_P64_R1_C64 180 -> 172; from R = 2 on the SiLU gate's math in chunk_scan outgrows what gate_grads
    # took (R2_C32 254 -> 258, N128_P64_R4_C16 447 -> 458, R8_C8 916 -> 966, N64_P128 628 -> 656, N128_P128
    # 928 -> 969).  Sweep of 81153fe without Z (2026-12-04_h200_sweep_noz_81153fe.json): it wins on every
    # split shape, the dPhi sums costing chunk_scan almost nothing (N128_P64_R4_C16 439 -> 401, N64_P128
    # 592 -> 497, N128_P128 929 -> 836, N256 1041 -> 967, N128_P32 388 -> 381, R8_C8 829 -> 814, R2_C32
    # 247 -> 228, R1_C64 166 -> 154).
    # Without Z, the fused storing scan (scan_outputs below) with a gate_grads pass after it, in place of chunk_scan
    # applying the gate, at N = 128, C * R = 64 and chunks of at most 16 tokens (SCAN_OUTPUTS_WITHOUT_Z_P).  H100,
    # dfc7f4a (2026-12-07_h100_sweep_noz_dfc7f4a_scan_outputs.json, graph us, gate in chunk_scan -> fused pass + Gluon
    # gate_grads / Triton): N128_P64_R4_C16 305.2 -> 283.7 / 283.7, N128_P32 254.8 -> 219.1 / 220.5, R8_C8 610.4 ->
    # 551.7 / 548.0; R2_C32 175.9 -> 179.0 / 178.4 (32-token chunks: a slower fused step) stays; R1_C64 does not fit.
    # Off Hopper the fused kernel does not run, and the split gate without it loses to chunk_scan's (section 19).
    # With the gate inside the fused pass (scan_outputs_gate, below) R2_C32 joins: H100, 3f04e36
    # (2026-12-07_h100_sweep_noz_3f04e36_gate_ring.json, graph us, gate in chunk_scan -> fused pass with the gate)
    # 176.1 -> 165.5.  R1_C64 does not fit the kernel's shared memory.  At N = 64 (H100, c99d456,
    # 2026-12-07_h100_sweep_noz_c99d456_n64.json, graph us, gate in chunk_scan -> fused pass with the gate): N64_P64
    # 223.3 -> 191.8; N64_P128 332.2 -> 381.8 (two 64-wide tiles: the gate's dz scratch holds no 128-wide one) stays.
    fused_shape = bool(swept and N in (64, 128) and chunk_size * R == 64)  # what the fused storing scan covers
    without_z_p = SCAN_OUTPUTS_WITHOUT_Z_P if N == 128 else SCAN_OUTPUTS_N64_WITHOUT_Z_P
    fused_without_z = bool(fused_shape and hopper and not has_z and P in without_z_p and chunk_size <= 32)
    gate_in_scan = bool(split_gate and (R == 1 or not has_z) and not fused_without_z)
    # The D skip in the gate's fp32 math (d_in_gate) on the split shapes with P <= 64.  Sweeps of 01845e8
    # (2026-12-05_h200_sweep_01845e8_*, graph us, off -> on), with Z: N128_P64_R4_C16 421 -> 409, N128_P32 354 -> 320,
    # R2_C32 250 -> 241, N256 807 -> 793, N16 271 -> 266, N64_P64 337 -> 332, N128_P128 812 -> 815, N64_P128
    # 464 -> 466; without Z (the gate in chunk_scan): N128_P64_R4_C16 400 -> 379, N128_P32 335 -> 323, N256 783 -> 774,
    # others within 1% (N64_P128 378 -> 385).  Not at P = 128: there gate_grads with the D skip spills 14 B at its
    # 128-register cap (none at P = 64, R = 4) and takes 99 -> 118 / 100 -> 121 us, more than chunk_scan saves
    # (N128_P128 812 -> 815, N64_P128 464 -> 466 with Z, 378 -> 385 without; optimization.md section 31).
    d_in_gate = bool(swept and split_gate and p_pow <= 64)
    # q's and k's bias add and rotation in bf16 (scan_half_rotation, out_half_rotation; optimization.md 29-30) with
    # chunk_scan's low-register order (out_q_cast_early, out_y_state_early) and, at N = 128, its 128-register cap
    # (four programs an SM), on the local-state shapes with bf16 products.  Same sweeps, d_in_gate -> all of it,
    # with Z: N128_P64_R4_C16 409 -> 373, R8_C8 803 -> 708, R2_C32 241 -> 216, R1_C64 160 -> 141, N128_P32
    # 320 -> 309, N64_P64 332 -> 323, N32 259 -> 250, N16 266 -> 258; without Z: N128_P64_R4_C16 379 -> 349, R8_C8
    # 761 -> 694, R2_C32 220 -> 197, R1_C64 145 -> 137, N128_P32 323 -> 315, N32 (fused) 225 -> 220, N64_P64
    # 292 -> 293.  It loses where the scan loads ahead (N64_P128 466 -> 482 with Z, 385 -> 446 without) and in the
    # two-pass scans (N256 793 -> 873, state scan 383 -> 476; N128_P128 815 -> 822; N16 without Z 248 -> 258).
    half_rotation = bool(swept and half_tables and local_states and not scan_prefetch)
    # chunk_scan alone takes them in the two-pass shapes at N = 256, whose uncapped kernel spilled 128 B at 255
    # registers (154 and no spill with them).  H100, d02587c (sweep_prepared.sh part 31, graph us, off -> on):
    # N256_P64_R4_C8 685 -> 661 with Z, 653 -> 633 without (chunk_scan 326 -> 303, 353 -> 330).  Not at P = 128:
    # N128_P128 668 -> 678, N64_P128 469 -> 519 (section 46).
    out_half_rotation = half_rotation or bool(swept and half_tables and not local_states and split_gate
                                              and half_pow >= 128)
    small_chunks = bool(split_gate and half_rotation and half_pow <= 16
                        and chunk_size * next_power_of_2(R) <= SMALL_CHUNK_ROWS)
    if small_chunks:
        # The single-chunk chunk_scan applies the gate with Z too (H100, c4cc822, graph us, N16_P64_R4_C8, gate_grads
        # -> gate in chunk_scan, both at 2 warps and 96 registers): 218.5 -> 207.9 (chunk_scan 96 + gate_grads 63 ->
        # 128 + group_sum 22); at 4 warps it loses (232.8 at a 64 cap, 266.9 at 128).
        gate_in_scan = True
    if split_gate:
        # 4 warps (8 lose everywhere: N128_P64_R4_C16 544 -> 809, N256 1051 -> 1316); 168 registers fit three
        # programs per SM (N128_P64_R4_C16 555 -> 544, R8_C8 1033 -> 911, R1_C64 193 -> 184, its 40 B of
        # spill included); N = 256 spills 1.1 KB at that cap and runs uncapped.
        # At N <= 64 a 128 cap fits four (16-24 B of spill): sweeps of 71fea87 (2026-12-04_h200_sweep_71fea87_
        # out_cap*.json, graph us, 168 -> 128) N16_P64_R4_C8 303 -> 279 (chunk_scan 156 -> 132), N32_P64_R4_C16
        # 298 -> 273, N64_P64_R4_C16 370 -> 347, N64_P128_R4_C16 521 -> 507, without Z (gate in chunk_scan)
        # N64_P128 395 -> 364; at N = 128 it spills 136-248 B and loses (N128_P64_R4_C16 440 -> 473, R8_C8
        # 888 -> 957, N128_P128 835 -> 881) but for R1_C64 (157 -> 153, 141 -> 139: within noise, not taken).
        # With the half rotation in the low-register order it spills 0-16 B there and wins (above).
        out_num_warps = 4
        if N <= 64 or half_rotation:
            out_max_registers = 128
        elif N <= 128:
            out_max_registers = 168
        if small_chunks:
            out_span_chunks = 1
            out_num_warps, out_max_registers = SMALL_CHUNK_SCAN
        if not gate_in_scan:
            gate_tokens = gate_tokens_per_program(B=B, H=H, S=S, R=R, P=P, num_sms=num_sms)
    # gate_grads as the Gluon kernel (TMA ring) at R = 4 and 8 (docs/optimization.md section 37).  H100, 78c9439,
    # CUDA-graph replays of gate_grads alone (Triton -> Gluon us): P = 64, R = 4 70.5 -> 65.0; N64_P128 135.8 -> 111.4;
    # N128_P32 40.4 -> 37.6; R8_C8 122.5 -> 98.8 (two ranks a thread); R2_C32 46.7 -> 47.3, a tie, left to Triton.  In
    # whole calls (profiler, gluon_gate off -> on): N16 72 -> 66, N128_P64_R4_C16 71 -> 68, N64_P128 114 -> 102.
    # Not at P = 128: on the H200 (6c2c07a, sweep_prepared.sh part 18, graph us, Triton -> Gluon) N64_P128 423 -> 432
    # (gate_grads 101 -> 108) and N128_P128 683 -> 691 (99 -> 107), where the H100 had them 1-3% faster; the H200's
    # bandwidth serves the Triton kernel's loads, and the Gluon one is held by its issue rate (section 39).
    gluon_gate = bool(swept and split_gate and not gate_in_scan and R in (4, 8) and p_pow <= 64)
    # The Gluon scan of the two-pass shapes in one segment: no end-state pass (section 39).  H100, d630d20, graph us:
    # N256_P64_R4_C8 767 -> 695, N128_P128_R4_C8 778 -> 697 (a 32-wide P tile: 709 / 719) (section 40).
    gluon_segments = 1 if swept and not local_states else 0
    # The segment fold as one scan over the segments (section 40).  H100, d630d20, graph us: N16 256 -> 252,
    # N128_P64_R4_C16 364 -> 361, R1_C64 158 -> 156, N64_P64 313 -> 313 (segment_entry 6-8 -> 3-5 us).
    fold_one_scan = bool(swept and local_states)
    # The flat token tables (section 44).  H100, 6f513c6, graph us (token_tables us): N16 208 -> 207 (7 -> 4),
    # N128_P64_R4_C16 360 -> 355 (16 -> 11), N256 693 -> 684 (30 -> 21), R1_C64 155 -> 149 (18 -> 12).
    flat_tables = bool(swept)
    # chunk_scan's stores after the loads they held back (section 45).  H100, fbb95b4, graph us (off -> on): the
    # entering state stored after q~ @ state at N64_P64 307 -> 297 with Z, 270 -> 262 without (N32 230 -> 228 and
    # 196 -> 194, N16 203 -> 204 and 156 -> 157: noise, left off); qk_dot stored after the products at N128_P128 with Z
    # 686 -> 664 (its 22 B of spill -> 8; N256 681 -> 681; at P = 64 it loses: N16 203 -> 223, N128_P64_R4_C16
    # 352 -> 366), and without Z (the gate in chunk_scan) 579 -> 562 (76ce761, part 29).
    defer_state_store = bool(half_rotation and N == 64 and p_pow == 64)
    defer_qk_dot = bool(swept and split_gate and not local_states and N == 128 and p_pow == 128)
    # cos / sin from the angles in chunk_scan and the Gluon scan (N >= 64), no tables (section 50).  H100, 1f1c3bd,
    # graph us (off -> on): N64_P64 270 -> 259, N128_P64_R4_C16 351 -> 337, N256 653 -> 641, N64_P128 464 -> 456,
    # N128_P32 264 -> 250, R8_C8 665 -> 624, R2_C32 217 -> 206, R1_C64 144 -> 136; N128_P128 667 -> 671 (chunk_scan's
    # spill at its 168 cap 8 -> 14 B), left off there.
    angles_in_kernels = bool(swept and split_gate and N >= 64 and not (N >= 128 and p_pow >= 128))
    # The fused storing scan (section 51) where one program's P tile is all of P.  H100, 224e676, graph us (off ->
    # on, segments of one wave): N128_P32_R4_C16 250.6 -> 229.0 (chunk_scan 153 + scan 50 -> fused pass 142 + end
    # pass 43).  Over two 32-wide P tiles it loses (N128_P64_R4_C16 336 -> 415, R8_C8 623 -> 813, R2_C32 205 -> 256);
    # with the 64-wide tile (q rotated in place, section 52; H100, 368a96c) it wins: N128_P64_R4_C16 337.3 -> 303.1,
    # R8_C8 624.4 -> 577.4 (8 segments), R2_C32 204.8 -> 193.4 (SCAN_OUTPUTS_P).  At N = 64, both halves stacked
    # (H100, c99d456, 2026-12-07_h100_sweep_c99d456_n64.json, graph us): N64_P64 256.2 -> 238.6 (chunk_scan 137 + scan
    # 42 + fold 3 -> fused 130 + end pass 36), N64_P128 453.4 -> 444.4 over a 128-wide tile (chunk_scan 243 + scan 86
    # + fold 4 -> fused 224 + end pass 73; gate_grads 112 -> 135), 487.8 over two 64-wide tiles.
    with_z_p = SCAN_OUTPUTS_P if N == 128 else SCAN_OUTPUTS_N64_P
    scan_outputs = bool(fused_shape and split_gate and not gate_in_scan and P in with_z_p)
    # Without Z the fused pass applies the gate itself (section 54's kernel; section 55).  H100, 3f04e36, graph us
    # (fused pass + gate_grads -> gate in the pass): N128_P64_R4_C16 283.8 -> 244.6, N128_P32 219.3 -> 211.0, R8_C8
    # 552.3 -> 515.9.  With Z it loses (a7409bf: 299.2 -> 335.3, 227.7 -> 242.4; section 54).
    scan_outputs_gate = bool(scan_outputs and not has_z)
    # The Gluon gate_grads also at P = 128 after the fused pass, which leaves it the D skip (chunk_scan had added it).
    # H100, cb373a9 (2026-12-07_h100_sweep_cb373a9_gluon_gate_p128.json, graph us, Triton -> Gluon): N64_P128 450.3 ->
    # 425.1 (gate_grads 136.2 -> 112.3); N128_P128 (chunk_scan adds the skip) 662.8 -> 660.4, left as it was.  On the
    # H200 the Triton kernel had won at P = 128 without the skip (section 39); with it, not timed there.
    gluon_gate = gluon_gate or bool(scan_outputs and not scan_outputs_gate and R in (4, 8) and p_pow >= 128)
    # Its per-token weights through the ring at chunks of 16 tokens or more.  H100, 3f04e36
    # (2026-12-07_h100_sweep_3f04e36_ring_weights.json, graph us, off -> on, fused kernel us), with Z:
    # N128_P64_R4_C16 298.2 -> 292.2 (177.7 -> 168.5), N128_P32 228.1 -> 226.8 (143.3 -> 137.3), R2_C32 192.5 ->
    # 179.6 (106.6 -> 95.1); at 8-token chunks it ties or loses (R8_C8 576.4 -> 578.6, 367.1 -> 369.6), and at N = 64
    # (c99d456, graph us): N64_P64 238.6 -> 243.7, N64_P128 444.4 -> 447.4, N64_P64 without Z 191.8 -> 196.2.
    scan_outputs_ring_weights = bool(scan_outputs and chunk_size >= 16 and N == 128)
    # The fused pass's log decays loaded a step ahead (section 58) at 16-token chunks at N = 128.  H100, 0f72967
    # (2026-12-07_h100_ab_0f72967_weights_ahead.json, graph us, off -> on): with Z N128_P64_R4_C16 291.3 -> 286.4,
    # N128_P32 228.1 -> 217.9; without Z N128_P64_R4_C16 244.8 -> 239.4, N128_P32 208.7 -> 208.0.  Where the
    # registers held across the step add spill it loses: R8_C8 577.2 -> 608.0, R2_C32 179.6 -> 189.5, N64_P128 416.5
    # -> 431.4 (N64_P64 a tie, 243.7 -> 242.3).
    scan_outputs_weights_ahead = bool(scan_outputs and chunk_size == 16 and N == 128)
    # Its intra-chunk weights once a (row, column token), broadcast over the column ranks (section 58; the whole
    # kernel 2560 -> 2448 SASS at N128_P64_R4_C16).  H100, 922d573 (2026-12-07_h100_sweep{,_noz}_922d573_fused_token_
    # weights.json, graph us, off -> on): with Z N64_P128 418.0 -> 394.0, N128_P32 219.7 -> 215.7, N64_P64 243.5 ->
    # 239.4, R2_C32 180.2 -> 177.2, R8_C8 580.6 -> 572.7, N128_P64_R4_C16 288.0 -> 286.2; without Z N128_P32 209.1 ->
    # 198.1, R8_C8 520.6 -> 503.9, R2_C32 163.1 -> 157.9, N64_P64 193.3 -> 189.9, but N128_P64_R4_C16 (the gate and
    # the decays ahead over a 64-wide tile) 242.3 -> 245.8 (fused kernel 185.6 -> 188.5), left off there.
    scan_outputs_token_weights = bool(scan_outputs and SCAN_OUTPUTS_TOKEN_WEIGHTS and not (
        scan_outputs_gate and scan_outputs_weights_ahead and P >= 64))
    # chunk_scan's intra-chunk weights once a (row, column token) (section 59), where chunk_scan runs with R > 1
    # without Z (the gate in chunk_scan).  H100, 494b354 (2026-12-07_h100_sweep{,_noz}_494b354_token_weights.json,
    # chunk_scan us off -> on): without Z N32 134.1 -> 131.2, N256 337.7 -> 332.4, N128_P128 270.8 -> 262.8, N16
    # 93.3 -> 92.6; with Z (no gate in it) it loses: N32 109.6 -> 114.3, N256 305.4 -> 318.2, N128_P128 271.9 ->
    # 276.3 (N16 a tie).
    out_token_weights = bool(swept and OUT_TOKEN_WEIGHTS and split_gate and not has_z and not scan_outputs and R > 1)
    # Its scores weighed before the v / Psi loads at one rank without Z, where that cuts spill (160 -> 128 B).  Same
    # run (..._early_mixing.json): R1_C64 without Z chunk_scan 79.7 -> 75.9 us (graph 128.4 -> 125.2); with Z 86.3
    # -> 85.7, N16 a tie.
    out_early_mixing = bool(swept and split_gate and not has_z and not scan_outputs and R == 1)
    if scan_outputs:
        span_chunks = SCAN_OUTPUTS_END_SPAN if (N, P) in SCAN_OUTPUTS_END_SPAN_SHAPES else 1
    return ScanConfig(block_p=block_p, n_segments=n_segments, block_half=block_half, out_block_p=out_block_p,
                      chunks_per_program=chunks_per_program, out_num_warps=out_num_warps,
                      ranks_per_step=ranks_per_step, out_span_chunks=out_span_chunks, end_span_chunks=span_chunks,
                      local_states=local_states, split_gate=split_gate, out_max_registers=out_max_registers,
                      gate_tokens=gate_tokens, state_span_chunks=state_span_chunks, gate_in_scan=gate_in_scan,
                      scan_max_registers=scan_max_registers, num_warps=num_warps, scan_prefetch=scan_prefetch,
                      d_in_gate=d_in_gate, scan_half_rotation=half_rotation, out_half_rotation=out_half_rotation,
                      out_q_cast_early=out_half_rotation, out_y_state_early=out_half_rotation, gluon_scan=swept,
                      gluon_gate=gluon_gate, gluon_segments=gluon_segments, fold_one_scan=fold_one_scan,
                      flat_tables=flat_tables, out_defer_state_store=defer_state_store,
                      out_defer_qk_dot=defer_qk_dot, out_token_weights=out_token_weights,
                      out_early_mixing=out_early_mixing,
                      angles_in_kernels=angles_in_kernels,
                      scan_outputs=scan_outputs, scan_outputs_gate=scan_outputs_gate,
                      scan_outputs_ring_weights=scan_outputs_ring_weights,
                      scan_outputs_weights_ahead=scan_outputs_weights_ahead,
                      scan_outputs_token_weights=scan_outputs_token_weights)


def gate_tokens_per_program(*, B, H, S, R, P, num_sms):
    """Tokens per ``gate_grads`` program: 128 tiles, fewer while that leaves under 2 programs per SM.

    Sweep of cfaa417 (gate_grads us at 32 / 64 / 128 / 256 tokens): N128_P64_R4_C16 116 / 83 / 66 / 56,
    N64_P128_R4_C16 219 / 159 / 128 / 112, N128_P64_R8_C8 179 / 161 / 153 / 189 (8-token tiles at R = 4,
    4-token tiles at R = 8: the best is 32 tiles a program in both, before the dz store lost its barrier).
    Sweep of ee6b22c, after the dz store lost its barrier (2026-12-04_h200_sweep_ee6b22c_gate_tokens.json, graph us
    at 128 / 256 / 512 tokens): N64_P128_R4_C16 525 / 508 / 497, N128_P128_R4_C8 853 / 835 / 825, R8_C8 888 / 883 /
    875, N128_P64_R4_C16 451 / 441 / 460 (512 tokens leave it 1.9 programs an SM).  Starting from 128 tiles moves
    the P = 128 shapes to 512 tokens and R8_C8 to 256; every other official shape keeps its count.
    """
    meta = gate_grads_meta(R=R, P=P)
    tokens = 128 * meta["BLOCK_T"]
    pblocks = cdiv(P, meta["BLOCK_P"])
    while tokens > meta["BLOCK_T"] and B * H * pblocks * cdiv(S, tokens) < 2 * num_sms:
        tokens //= 2
    return tokens


def rotation_table_dtype(*activation_dtypes):
    """dtype of the cos / sin tables for a call with these activation dtypes (q, k, v, dout, z).

    Where the products take bf16 operands (any bf16 activation) the rotated rows are rounded to bf16 (2^-9)
    before they are used, so fp16 tables (2^-12) add an eighth of that and halve the tables' traffic: written
    once, read by the state scans and the output stage (34 / 67 MB of fp32 tables at N = 128 / 256 on the
    official grid; official grid at f67b954 against 3162298, graph us: N256_P64_R4_C8 975 -> 905, its
    chunk_scan 400 -> 346 at fewer registers).  Elsewhere fp32.
    """
    return torch.float16 if torch.bfloat16 in activation_dtypes else torch.float32


def raw_y_scratch_dtype(*activation_dtypes):
    """dtype of the split output stage's raw_y scratch (``ScanConfig.half_raw_y``) for these activation dtypes.

    Where the products take bf16 operands (any bf16 activation) raw_y already carries their 2^-9 rounding, so
    fp16 rows with a power-of-two scale each (2^-12) add an eighth of it and halve the scratch's traffic both
    ways (``fp16_row_scaled``).  With fp16 operands (2^-11) the scratch's rounding would be as large as theirs:
    in the interpreter dz's MARE on a GPU pairwise row went from 0.24 to 0.53 of the dual benchmark's bound with
    fp16 activations, so there, and for fp32 activations, the scratch stays fp32.
    """
    return torch.float16 if torch.bfloat16 in activation_dtypes else torch.float32


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def inner_chunk_size(chunk_size, R):
    """The chunk the kernels walk for a call with this ``chunk_size`` and R: ``chunk_size`` itself where its
    (token, rank) rows fit ``MAX_KERNEL_ROWS``, else its largest divisor whose rows do."""
    block_r = next_power_of_2(R)
    if next_power_of_2(chunk_size) * block_r <= MAX_KERNEL_ROWS:
        return chunk_size
    return max(c for c in range(1, chunk_size + 1) if chunk_size % c == 0 and next_power_of_2(c) * block_r
               <= MAX_KERNEL_ROWS)


def inner_chunk_decays(*, da_cs, da_cs_rev, chunk_size, inner_chunk):
    """da_cs and da_cs_rev of chunks of ``inner_chunk`` tokens from those of ``chunk_size`` (a multiple of it).

    da_cs[t] is the log-decay sum from t's chunk start to t, da_cs_rev[t] the sum after t to the chunk's last valid
    token; each inner chunk lies inside one outer chunk, so its sums are differences of the outer ones:
        da_cs'[t]     = da_cs[t] - da_cs[inner start - 1]          (0 subtracted for an outer chunk's first)
        da_cs_rev'[t] = da_cs_rev[t] - da_cs_rev[inner last valid]
    Args: da_cs, da_cs_rev: [B, H, S] fp32.  Returns the two new [B, H, S] fp32 tensors.
    """
    S = da_cs.shape[2]
    t = torch.arange(S, device=da_cs.device)
    inner_start = t - (t % chunk_size) % inner_chunk
    starts_outer = inner_start % chunk_size == 0
    before = da_cs[:, :, (inner_start - 1).clamp(min=0)]
    inner_da_cs = da_cs - before.masked_fill(starts_outer, 0.0)
    inner_last = torch.clamp(inner_start + inner_chunk - 1, max=S - 1)
    inner_da_cs_rev = da_cs_rev - da_cs_rev[:, :, inner_last]
    return inner_da_cs.contiguous(), inner_da_cs_rev.contiguous()


def production_bwd_fwd(*, q, da_cs, da_cs_rev, states, chunk_size, **rest):
    """Fill every output in place (tensors as in ``stage0_bwd_fwd``; segsum is derived from da_cs).

    A chunk of more (token, rank) rows than ``MAX_KERNEL_ROWS`` is walked as inner chunks (``inner_chunk_size``):
    the result does not depend on where chunks are cut, and the states entering the call's chunks are every
    ``chunk_size / inner`` th of the inner chunks' (copied out at the end).  Above that size the output stage's
    [rows, rows] score tile and the scans' operands took 128-288 KB of shared memory at N >= 128, over the 99 KB bound
    and at N = 256 over an H200's 227 KB (benchmarks/aot_report.py, docs/optimization.md section 41).
    """
    R = q.shape[2]
    inner = inner_chunk_size(chunk_size, R)
    if inner == chunk_size:
        _production_chunks(q=q, da_cs=da_cs, da_cs_rev=da_cs_rev, states=states, chunk_size=chunk_size, **rest)
        return
    B, H, _, N, P = states.shape
    inner_da_cs, inner_da_cs_rev = inner_chunk_decays(da_cs=da_cs, da_cs_rev=da_cs_rev, chunk_size=chunk_size,
                                                      inner_chunk=inner)
    inner_states = torch.empty((B, H, cdiv(q.shape[1], inner), N, P), device=states.device, dtype=states.dtype)
    _production_chunks(q=q, da_cs=inner_da_cs, da_cs_rev=inner_da_cs_rev, states=inner_states, chunk_size=inner,
                       **rest)
    forbid_replay()  # torch ops around the launches: a call replay would miss them
    states.copy_(inner_states[:, :, ::chunk_size // inner])


def _gluon_scan(config, *, scan, states):
    """The ``gluon_state_scan`` module where ``config`` asks for it and it covers these scan arguments, else None."""
    if not config.gluon_scan:
        return None
    from . import gluon_state_scan

    return gluon_state_scan if gluon_state_scan.unsupported(**scan, states=states) is None else None


def _end_pass_scan(config, gluon, *, scan):
    """The Gluon end-state pass's scan arguments: spans of ``end_span_chunks`` chunks as chunks of their own, on the
    spans' decay tables, where that kernel covers the longer chunk (within 99 KB without state stores; the segments
    hold whole spans, as the caller sized them); else ``scan`` itself.  The end states are the same either way."""
    span = config.end_span_chunks
    C, k, v = scan["chunk_size"], scan["k"], scan["v"]
    if span == 1 or scan["n_segments"] == 1 or scan["chunks_per_segment"] % span:
        return scan
    B, S, R, G, N = k.shape
    trig = rotation_source("gluon_state_scan", k, scan.get("cos_angles"), scan.get("sin_angles"), scan.get("angles"),
                           scan.get("table_dtype"))
    # The pass stores no states: its stand-in for them is bf16.
    problems = gluon.shape_problems(B=B, S=S, R=R, G=G, N=N, H=v.shape[2], P=v.shape[3], RD=trig["RD"],
                                    chunk_size=span * C, block_p=scan["block_p"], store_states=False,
                                    dtypes=(k.dtype, trig["table_dtype"], torch.bfloat16))
    if problems:
        return scan
    span_da_cs, span_da_cs_rev = span_decays(da_cs=scan["da_cs"], da_cs_rev=scan["da_cs_rev"], chunk_size=C,
                                             span_chunks=span)
    return dict(scan, chunk_size=span * C, chunks_per_segment=scan["chunks_per_segment"] // span, da_cs=span_da_cs,
                da_cs_rev=span_da_cs_rev)


def _scan_outputs(config, *, gluon, scan, q, states, qk_dot, half_rotation, gate):
    """(the ``gluon_scan_outputs`` module, its P tile, whether it applies the gate, whether it adds the D skip to
    raw_y) where ``config`` asks for it (``scan_outputs`` with the stored raw_y and the Gluon scan) and it covers this
    call, else (None, None, False, False).  ``gate``: the gate's inputs and dz (``gluon_scan_outputs.scan_outputs``'
    dict, less the partials), taken where ``scan_outputs_gate`` asks for it and the kernel covers it; else raw_y is
    stored for ``gate_grads``, with the D skip where ``scan_outputs_d_skip`` asks for it."""
    if not (config.scan_outputs and config.split_gate and not config.gate_in_scan and gluon):
        return None, None, False, False
    from . import gluon_scan_outputs

    rotation = {name: scan.get(name) for name in ("cos_angles", "sin_angles", "angles", "table_dtype")}
    tile = dict(half_rotation=half_rotation, block_p=config.scan_outputs_block_p or None,
                ring_weights=config.scan_outputs_ring_weights)
    covered = dict(q=q, k=scan["k"], v=scan["v"], states=states, chunk_size=scan["chunk_size"],
                   tensors=dict(qk_dot=qk_dot), **rotation, **tile)
    with_gate = bool(config.scan_outputs_gate) and gluon_scan_outputs.unsupported(**covered, gate=gate) is None
    d_skip = not with_gate and config.scan_outputs_d_skip and gate["d"] is not None
    if not with_gate and gluon_scan_outputs.unsupported(**covered, d=gate["d"] if d_skip else None) is not None:
        return None, None, False
    layout = gluon_scan_outputs.plan(C=scan["chunk_size"], R=q.shape[2], P=scan["v"].shape[3], N=q.shape[4],
                                     gate_form=gluon_scan_outputs.gate_form_of(gate if with_gate else None),
                                     d_skip=d_skip, **tile)
    return gluon_scan_outputs, layout.block_p, with_gate, d_skip


def _production_chunks(*, q, k, v, dout, z, angles, q_bias, k_bias, mimo_v, mimo_o, mimo_z, d,
                       da_cs, da_cs_rev, dt, trap, states, qk_dot, dmimo_o, dmimo_z, dz,
                       chunk_size, dot_dtype, dot_precision, config=None):
    """production_bwd_fwd for a chunk of at most ``MAX_KERNEL_ROWS`` (token, rank) rows."""
    B, S, R, G, N = q.shape
    H, P = v.shape[2], v.shape[3]
    activation_dtypes = [x.dtype for x in (q, k, v, dout, z) if x is not None]
    rotation_dtype = rotation_table_dtype(*activation_dtypes)
    if config is None:
        num_sms = _sm_count(q.device.index) if q.is_cuda else 4
        config = choose_config(B=B, H=H, S=S, N=N, P=P, R=R, chunk_size=chunk_size, num_sms=num_sms,
                               has_z=z is not None, half_tables=rotation_dtype == torch.float16,
                               hopper=compiled_for_hopper(q))
    if config.split_gate and compiled_for_gpu(q):
        # chunk_scan refuses these tiles too; here it is before the first launch.
        meta = chunk_scan_meta(chunk_size=chunk_size, R=R, N=N, block_p=config.out_block_p,
                               span_chunks=config.out_span_chunks)
        refuse_miscompiled_tile(meta, block_p=config.out_block_p, N=N, R=R, dot_dtype=dot_dtype)
    with dependent_launches(config.pdl and dependent_launch_supported(q)):
        scan_rotation = rotation_math_dtype(dot_dtype, config.scan_half_rotation)
        out_rotation = rotation_math_dtype(dot_dtype, config.out_half_rotation)
        if scan_rotation == out_rotation != tl.float32:
            # Every stage rotates in the products' 16-bit dtype: tables in it spare a conversion a row.  Where one stage
            # rotates in fp32 the tables keep their precision for it.
            rotation_dtype = torch.bfloat16 if out_rotation == tl.bfloat16 else torch.float16
        nch = cdiv(S, chunk_size)
        # The output stage reads the states back; when ``states`` is stored coarser than the inputs
        # (fp32 inputs, half outputs) it reads an fp32 copy instead, so the gradients keep input accuracy.
        input_eps = min(torch.finfo(x.dtype).eps for x in (q, k, v, dout))
        handoff = states
        if torch.finfo(states.dtype).eps > input_eps:
            handoff = torch.empty(states.shape, device=states.device, dtype=torch.float32)
        # cos / sin as the kernels take them: the 16-bit tables' values from the angles (ScanConfig.angles_in_kernels)
        # in chunk_scan and the Gluon scan, the tables elsewhere.
        from_angles = None
        if config.angles_in_kernels and config.split_gate and rotation_dtype != torch.float32:
            from_angles = dict(cos_angles=None, sin_angles=None, angles=angles, table_dtype=rotation_dtype)
        scan = dict(k=k, v=v, k_bias=k_bias, mimo_v=mimo_v, da_cs=da_cs, da_cs_rev=da_cs_rev, chunk_size=chunk_size,
                    block_half=config.block_half, block_p=config.block_p, dot_dtype=dot_dtype,
                    dot_precision=dot_precision, num_warps=config.num_warps, max_registers=config.scan_max_registers,
                    prefetch=config.scan_prefetch, skip_unrotated=config.scan_skip_unrotated,
                    rotation_math_dtype=scan_rotation)
        tables = gluon = weights = None
        if from_angles:
            # Whether the Gluon scan takes the angles decides whether the tables are written at all, so its coverage
            # is checked first, against the weight tables' storage (allocated here for their addresses).
            weights = torch.empty((2,) + tuple(dt.shape), device=dt.device, dtype=torch.float32)
            gluon = _gluon_scan(config, scan=dict(scan, **from_angles, trap_scale=weights[1]), states=handoff)
        gamma, trap_scale, cos_angles, sin_angles = token_tables(
            dt=dt, trap=trap, angles=angles, rotation_dtype=rotation_dtype, flat=config.flat_tables,
            cos_sin=gluon is None, weights=weights)
        scan.update(gamma=gamma, trap_scale=trap_scale)
        if gluon is None:
            # A Triton scan reads the tables (chunk_scan still takes the angles where from_angles is set).
            tables = dict(cos_angles=cos_angles, sin_angles=sin_angles)
            scan.update(tables)
            if not from_angles:
                gluon = _gluon_scan(config, scan=scan, states=handoff)
        else:
            scan.update(from_angles)
        scan_rotation_16bit = scan_rotation != tl.float32
        fused_gate = dict(dout=dout, z=z, mimo_o=mimo_o, mimo_z=mimo_z, d=d, dz=dz)
        fused, fused_block_p, gate_in_pass, d_in_pass = _scan_outputs(
            config, gluon=gluon, scan=scan, q=q, states=handoff, qk_dot=qk_dot, half_rotation=scan_rotation_16bit,
            gate=fused_gate)
        wanted_segments = config.n_segments
        if fused:
            # gluon_segments, or as many as one wave of programs holds (more where segments would exceed 32 chunks).
            programs = B * H * (P // fused_block_p)
            wave = SCAN_OUTPUTS_PROGRAMS_PER_SM * _sm_count(q.device.index) // programs
            wanted_segments = config.gluon_segments or max(1, min(
                max(wave, nch // SCAN_OUTPUTS_SEGMENT_CHUNKS), nch // MIN_CHUNKS_PER_SEGMENT))
        elif gluon and not config.local_states and config.gluon_segments:
            wanted_segments = config.gluon_segments
        # Segments hold whole steps of both scans.
        span = math.lcm(config.state_span_chunks, 1 if config.local_states and not fused else config.end_span_chunks)
        chunks_per_segment = cdiv(cdiv(nch, wanted_segments), span) * span
        n_segments = cdiv(nch, chunks_per_segment)
        scan.update(n_segments=n_segments, chunks_per_segment=chunks_per_segment)
        local = config.local_states and n_segments > 1 and not fused
        seg_entry = entry_decay = None
        if local:
            if gluon:
                seg_entry = gluon.gluon_chunk_local_states(**scan, states=handoff)
            else:
                seg_entry = chunk_local_states(**scan, states=handoff, span_chunks=config.state_span_chunks)
            entry_decay = segment_entry_states(seg_state=seg_entry, da_cs=da_cs, chunk_size=chunk_size,
                                               chunks_per_segment=chunks_per_segment,
                                               precise_exp=precise_exp(dot_dtype, da_cs),
                                               one_scan=config.fold_one_scan)
        elif fused:
            # The storing pass runs with the outputs below.  The end-state pass over the fused kernel's P tile (at 32
            # twice the programs of a 64-wide one, for a pass that has one segment fewer than the storing pass), at
            # most the Gluon scan's widest (a 128-wide fused tile at N = 64).
            # Named, as seg_end below: the span tables it may allocate live to the end of the call, so their block is
            # not handed out again within it (the call record would give the reuse a region of its own: a larger
            # replay scratch; launch.py, section 57).
            end_tile = min(fused_block_p, GLUON_SCAN_MAX_BLOCK_P)
            end_scan = _end_pass_scan(config, gluon, scan=dict(scan, block_p=end_tile))
            seg_end = gluon.gluon_segment_end_states(**end_scan)
        elif gluon:
            seg_end = gluon.gluon_segment_end_states(**scan)
            gluon.gluon_chunk_states(**scan, seg_state=seg_end, states=handoff)
        else:
            # Named, so that it lives to the end of the call like every other scratch tensor: no block is handed out
            # twice within a call, which keeps a recorded call's scratch layout the same from call to call.
            seg_end = segment_end_states(**dict(scan, prefetch=config.scan_prefetch or config.end_scan_prefetch),
                                         span_chunks=config.end_span_chunks)
            chunk_states(**scan, seg_state=seg_end, states=handoff, span_chunks=config.state_span_chunks)
        output_stage = dict(
            q=q, k=k, v=v, **(from_angles or tables), q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v,
            d=d, da_cs=da_cs, da_cs_rev=da_cs_rev, gamma=gamma, trap_scale=trap_scale, states=handoff, qk_dot=qk_dot,
            chunk_size=chunk_size, block_p=config.out_block_p, dot_dtype=dot_dtype, dot_precision=dot_precision,
            num_warps=config.out_num_warps, span_chunks=config.out_span_chunks, seg_entry=seg_entry,
            entry_decay=entry_decay, chunks_per_segment=chunks_per_segment,
            q_cast_early=config.out_q_cast_early, y_state_early=config.out_y_state_early,
            rotation_math_dtype=out_rotation, defer_state_store=config.out_defer_state_store,
            defer_qk_dot=config.out_defer_qk_dot, token_weights=config.out_token_weights,
            early_mixing=config.out_early_mixing)
        # The fused storing pass leaves the D skip to gate_grads, unless it adds it to raw_y itself.
        d_in_gate = (config.d_in_gate or fused is not None) and d is not None and not d_in_pass
        if fused:
            # The fused storing pass: either raw_y for gate_grads, or (gate) the gate applied in the pass.
            run_fused = functools.partial(fused.scan_outputs, **dict(scan, block_p=fused_block_p), q=q, q_bias=q_bias,
                                          states=handoff, seg_state=seg_end, qk_dot=qk_dot,
                                          half_rotation=scan_rotation_16bit,
                                          ring_weights=config.scan_outputs_ring_weights,
                                          weights_ahead=config.scan_outputs_weights_ahead,
                                          token_weights=config.scan_outputs_token_weights,
                                          d=d if d_in_pass else None)
        if gate_in_pass:
            # Its segments' partials, no raw_y scratch, no gate_grads.
            dphi = torch.empty((B, H, n_segments, R, P), device=q.device, dtype=torch.float32)
            dzeta = torch.empty_like(dphi) if z is not None else None
            run_fused(raw_y=None, raw_y_scale=None, gate=dict(fused_gate, dphi=dphi, dzeta=dzeta))
        elif config.split_gate and config.gate_in_scan:
            dphi, dzeta = chunk_scan(**output_stage, dout=dout, z=z, mimo_o=mimo_o, mimo_z=mimo_z, dz=dz,
                                     max_registers=config.out_max_registers,
                                     spans_per_program=config.chunks_per_program, d_in_gate=d_in_gate)
        elif config.split_gate:
            # dz sums raw_y over ranks, and where those terms cancel the scratch's rounding shows in full: a bf16 raw_y
            # (2^-9) tipped dz over the dual benchmark on the GPU (test_gpu_pairwise B1-S32-H2-bf16-Z-D-G1: MERE
            # 1.18e-1 > 2 x 5.34e-2 at 9d55f71).  fp16 scaled per row is 2^-12 at half fp32's bytes.
            raw_y_dtype = torch.float32
            if config.half_raw_y:
                raw_y_dtype = raw_y_scratch_dtype(*activation_dtypes)
            raw_y = torch.empty((B, H, S, R, P), device=q.device, dtype=raw_y_dtype)
            raw_y_scale = None
            scale_block_p = fused_block_p if fused else config.out_block_p
            if raw_y_dtype == torch.float16:
                raw_y_scale = torch.empty((B, H, S, R, cdiv(P, scale_block_p)), device=q.device,
                                          dtype=torch.float32)
            if fused:
                run_fused(raw_y=raw_y, raw_y_scale=raw_y_scale)
            else:
                chunk_scan(**dict(output_stage, d=None if d_in_gate else d), raw_y=raw_y, raw_y_scale=raw_y_scale,
                           max_registers=config.out_max_registers, spans_per_program=config.chunks_per_program)
            skip = dict(v=v, mimo_v=mimo_v, d=d) if d_in_gate else {}
            gate = dict(raw_y=raw_y, raw_y_scale=raw_y_scale, scale_block_p=scale_block_p, dout=dout, z=z,
                        mimo_o=mimo_o, mimo_z=mimo_z, dz=dz, tokens_per_program=config.gate_tokens, **skip)
            gate_kernel = functools.partial(gate_grads, tile_elements=config.gate_tile_elements,
                                            num_warps=config.gate_num_warps)
            if config.gluon_gate:
                from . import gluon_gate_grads

                if gluon_gate_grads.unsupported(**gate, block_p=gluon_gate_grads.tile_columns(
                        R=R, P=P, scale_block_p=scale_block_p)) is None:
                    gate_kernel = gluon_gate_grads.gluon_gate_grads
            dphi, dzeta = gate_kernel(**gate)
        else:
            dphi, dzeta = chunk_output(q=q, k=k, v=v, dout=dout, z=z, cos_angles=cos_angles, sin_angles=sin_angles,
                                       q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, mimo_o=mimo_o, mimo_z=mimo_z, d=d,
                                       da_cs=da_cs, da_cs_rev=da_cs_rev, gamma=gamma, trap_scale=trap_scale,
                                       states=handoff, qk_dot=qk_dot, dz=dz, chunk_size=chunk_size,
                                       chunks_per_program=config.chunks_per_program, block_p=config.out_block_p,
                                       dot_dtype=dot_dtype, dot_precision=dot_precision,
                                       num_warps=config.out_num_warps, ranks_per_step=config.ranks_per_step,
                                       span_chunks=config.out_span_chunks, seg_entry=seg_entry,
                                       entry_decay=entry_decay, chunks_per_segment=chunks_per_segment,
                                       rotation_math_dtype=out_rotation)
        if handoff is not states:
            forbid_replay()  # a torch copy between the launches: a call replay would miss it
            states.copy_(handoff)
        sum_group_partials(dphi_partial=dphi, dzeta_partial=dzeta, dmimo_o=dmimo_o, dmimo_z=dmimo_z)
