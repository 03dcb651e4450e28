"""Segment state passing: the state entering every segment, from the segments' own end states.

With ``chunk_local_states`` each segment of a (b, h) sequence is scanned from a zero state, so
its end state ``end_s`` counts its own tokens only.  The state entering segment s is then

    entry_0 = 0,    entry_{s+1} = exp(log decay of segment s) * entry_s + end_s,

a serial walk over ``n_segments`` small steps, elementwise over the [N, P] state: one program per
(b, h, tile of the flattened state).  It overwrites ``seg_state`` in place (entry s replaces
end s, which only the step s read), and writes the table ``entry_decay`` of each chunk's decay from
its segment's start, which the output stage scales the entry state by.
"""

import torch
import triton
import triton.language as tl

from .host_utils import cdiv, next_power_of_2
from .launch import launch
from .triton_utils import exp_fp32, wait_for_previous_grid

# Elements of the flattened [N, P] state per program: a (b, h) takes N * P / 1024 programs.
BLOCK_STATE = 1024
# Elements of one [segments, state elements] tile of the one-scan fold.
SCAN_TILE_ELEMENTS = 4096


@triton.jit
def _segment_entry_kernel(
    seg_state_ptr, da_cs_ptr, entry_decay_ptr, S, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, STATE_SIZE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SEG_CHUNKS: tl.constexpr,
    PRECISE_EXP: tl.constexpr = False,
    GDC: tl.constexpr = False,
):
    bh = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < STATE_SIZE
    seg_seq = seg_state_ptr + bh * N_SEGMENTS * STATE_SIZE + offs
    da_cs_seq = da_cs_ptr + bh * S
    entry = tl.zeros((BLOCK,), dtype=tl.float32)
    idx = tl.arange(0, BLOCK_SEG_CHUNKS)
    if GDC:
        # Under programmatic dependent launch the decay table (from da_cs, an input of the call) is written before the
        # wait for the scan that writes seg_state; only the chunk_scan after this kernel reads it.
        if tl.program_id(0) == 0:
            for s in range(0, N_SEGMENTS):
                chunk = s * CHUNKS_PER_SEG + idx
                valid = (idx < CHUNKS_PER_SEG) & (chunk < NCH)
                log_decay = tl.load(da_cs_seq + tl.minimum(chunk * C + C - 1, S - 1), mask=valid, other=0.0)
                before = tl.cumsum(log_decay, axis=0) - log_decay
                tl.store(entry_decay_ptr + bh * NCH + chunk, exp_fp32(before, PRECISE_EXP), mask=valid)
        wait_for_previous_grid(GDC)
    for s in range(0, N_SEGMENTS):
        # The log decays of the segment's chunks (da_cs at a chunk's last valid token): their sum decays the
        # entry state across the segment, their exclusive running sum is each chunk's decay from the segment's
        # start (the table the output stage scales the entry state by; one program per (b, h) stores it).
        chunk = s * CHUNKS_PER_SEG + idx
        valid = (idx < CHUNKS_PER_SEG) & (chunk < NCH)
        log_decay = tl.load(da_cs_seq + tl.minimum(chunk * C + C - 1, S - 1), mask=valid, other=0.0)
        if not GDC:
            if tl.program_id(0) == 0:
                before = tl.cumsum(log_decay, axis=0) - log_decay
                tl.store(entry_decay_ptr + bh * NCH + chunk, exp_fp32(before, PRECISE_EXP), mask=valid)
        # The last segment's end state is not needed: its slot only receives the entry state.
        end = tl.load(seg_seq + s * STATE_SIZE, mask=mask & (s < N_SEGMENTS - 1), other=0.0)
        tl.store(seg_seq + s * STATE_SIZE, entry, mask=mask)
        entry = entry * exp_fp32(tl.sum(log_decay, axis=0), PRECISE_EXP) + end


@triton.jit
def _linear_recurrence(decay_a, value_a, decay_b, value_b):
    """``tl.associative_scan``'s combine for h_s = a_s h_{s-1} + x_s: (a, x) followed by (b, y) is (a b, x b + y)."""
    return decay_a * decay_b, value_a * decay_b + value_b


@triton.jit
def _segment_entry_scan_kernel(
    seg_state_ptr, da_cs_ptr, entry_decay_ptr, S, NCH, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, STATE_SIZE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SEG_CHUNKS: tl.constexpr,
    BLOCK_SEGMENTS: tl.constexpr, PRECISE_EXP: tl.constexpr = False, GDC: tl.constexpr = False,
):
    """_segment_entry_kernel with every segment at once: [segments, BLOCK] tiles of the end states, loaded together,
    and one associative scan over the segments, where the serial walk waited on a load and a store a segment."""
    bh = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < STATE_SIZE
    da_cs_seq = da_cs_ptr + bh * S
    seg = tl.arange(0, BLOCK_SEGMENTS)[:, None]
    idx = tl.arange(0, BLOCK_SEG_CHUNKS)[None, :]
    # The log decays of every segment's chunks (da_cs at a chunk's last valid token): their exclusive running sum along
    # a segment is each chunk's decay from the segment's start (the table the output stage scales the entry state by;
    # one program per (b, h) stores it, before the wait: da_cs is an input of the call).
    chunk = seg * CHUNKS_PER_SEG + idx
    valid = (seg < N_SEGMENTS) & (idx < CHUNKS_PER_SEG) & (chunk < NCH)
    log_decay = tl.load(da_cs_seq + tl.minimum(chunk * C + C - 1, S - 1), mask=valid, other=0.0)
    if tl.program_id(0) == 0:
        before = tl.cumsum(log_decay, axis=1) - log_decay
        tl.store(entry_decay_ptr + bh * NCH + chunk, exp_fp32(before, PRECISE_EXP), mask=valid)
    wait_for_previous_grid(GDC)
    # Row s takes segment s - 1's end state and decay (row 0: nothing, decay 1), so the inclusive scan of
    # h_s = decay_{s-1} h_{s-1} + end_{s-1} is the entry state of segment s.  The last segment's end is never read.
    prev_chunk = chunk - CHUNKS_PER_SEG
    prev_valid = (seg >= 1) & (seg < N_SEGMENTS) & (idx < CHUNKS_PER_SEG)
    prev_log_decay = tl.load(da_cs_seq + tl.minimum(prev_chunk * C + C - 1, S - 1), mask=prev_valid, other=0.0)
    decay = exp_fp32(tl.sum(prev_log_decay, axis=1), PRECISE_EXP)[:, None] + tl.zeros((BLOCK_SEGMENTS, BLOCK),
                                                                                     tl.float32)
    rows = seg_state_ptr + (bh * N_SEGMENTS + seg) * STATE_SIZE + offs[None, :]
    ends = tl.load(rows - STATE_SIZE, mask=(seg >= 1) & (seg < N_SEGMENTS) & mask[None, :], other=0.0)
    _, entries = tl.associative_scan((decay, ends), axis=0, combine_fn=_linear_recurrence)
    tl.store(rows, entries, mask=(seg < N_SEGMENTS) & mask[None, :])


def segment_entry_states(*, seg_state, da_cs, chunk_size, chunks_per_segment, precise_exp=False, one_scan=False):
    """Turn the segments' end states into their entry states, in place, and return each chunk's decay from
    its segment's start (what the output stage scales a segment's entry state by).

    Args:
        seg_state: [B, H, n_segments, N, P] fp32 from ``chunk_local_states`` (end states; the last
            entry is ignored), overwritten with the entry states (entry 0 is zeros);
        da_cs: [B, H, S] fp32; chunk_size; chunks_per_segment: chunks of every segment but the last;
        precise_exp: libdevice's exp (``host_utils.precise_exp``: fp32 products on the GPU);
        one_scan: every segment at once, an associative scan over them (``_segment_entry_scan_kernel``), instead of
            the serial walk over the segments.
    Returns:
        entry_decay: [B, H, nch] fp32, exp(sum of the log decays of the segment's chunks before chunk c)
        (1 for a segment's first chunk).
    """
    B, H, n_segments, N, P = seg_state.shape
    S = da_cs.shape[2]
    nch = cdiv(S, chunk_size)
    entry_decay = torch.empty((B, H, nch), device=seg_state.device, dtype=torch.float32)
    if one_scan:
        block_segments = next_power_of_2(n_segments)
        # Two [segments, block] fp32 tiles a program (the decays and the states): 4096 elements each at most.
        block = max(64, min(BLOCK_STATE, SCAN_TILE_ELEMENTS // block_segments))
        launch(_segment_entry_scan_kernel, (cdiv(N * P, block), B * H),
               seg_state, da_cs, entry_decay, S, nch, chunks_per_segment, n_segments,
               C=chunk_size, STATE_SIZE=N * P, BLOCK=block, BLOCK_SEG_CHUNKS=next_power_of_2(chunks_per_segment),
               BLOCK_SEGMENTS=block_segments, PRECISE_EXP=precise_exp, num_warps=4)
        return entry_decay
    launch(_segment_entry_kernel, (cdiv(N * P, BLOCK_STATE), B * H),
        seg_state, da_cs, entry_decay, S, nch, chunks_per_segment, n_segments,
        C=chunk_size, STATE_SIZE=N * P, BLOCK=BLOCK_STATE, BLOCK_SEG_CHUNKS=next_power_of_2(chunks_per_segment),
        PRECISE_EXP=precise_exp, num_warps=4,
    )
    return entry_decay
