"""Segment state passing: the state entering every segment, from the segments' own end states.

With ``chunk_local_states`` each segment of a (b, h) sequence is scanned from a zero state, so
its end state ``end_s`` counts its own tokens only.  The state entering segment s is then

    entry_0 = 0,    entry_{s+1} = exp(log decay of segment s) * entry_s + end_s,

a serial walk over ``n_segments`` small steps, elementwise over the [N, P] state: one program per
(b, h, tile of the flattened state).  It overwrites ``seg_state`` in place (entry s replaces
end s, which only the step s read).
"""

import triton
import triton.language as tl

from .host_utils import cdiv, next_power_of_2
from .launch import launch
from .triton_utils import chunk_run_log_decay

# Elements of the flattened [N, P] state per program: a (b, h) takes N * P / 1024 programs.
BLOCK_STATE = 1024


@triton.jit
def _segment_entry_kernel(
    seg_state_ptr, da_cs_ptr, S, CHUNKS_PER_SEG, N_SEGMENTS,
    C: tl.constexpr, STATE_SIZE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SEG_CHUNKS: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < STATE_SIZE
    seg_seq = seg_state_ptr + bh * N_SEGMENTS * STATE_SIZE + offs
    da_cs_seq = da_cs_ptr + bh * S
    entry = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, N_SEGMENTS - 1):
        end = tl.load(seg_seq + s * STATE_SIZE, mask=mask, other=0.0)
        tl.store(seg_seq + s * STATE_SIZE, entry, mask=mask)
        # Every segment but the last holds CHUNKS_PER_SEG whole chunks inside the sequence.
        seg_decay = tl.exp(chunk_run_log_decay(da_cs_seq, s * CHUNKS_PER_SEG, CHUNKS_PER_SEG, S, C,
                                               BLOCK_SEG_CHUNKS))
        entry = entry * seg_decay + end
    tl.store(seg_seq + (N_SEGMENTS - 1) * STATE_SIZE, entry, mask=mask)


def segment_entry_states(*, seg_state, da_cs, chunk_size, chunks_per_segment):
    """Turn the segments' end states into their entry states, in place.

    Args:
        seg_state: [B, H, n_segments, N, P] fp32 from ``chunk_local_states`` (end states; the last
            entry is ignored), overwritten with the entry states (entry 0 is zeros);
        da_cs: [B, H, S] fp32; chunk_size; chunks_per_segment: chunks of every segment but the last.
    """
    B, H, n_segments, N, P = seg_state.shape
    S = da_cs.shape[2]
    launch(_segment_entry_kernel, (cdiv(N * P, BLOCK_STATE), B * H),
        seg_state, da_cs, S, chunks_per_segment, n_segments,
        C=chunk_size, STATE_SIZE=N * P, BLOCK=BLOCK_STATE, BLOCK_SEG_CHUNKS=next_power_of_2(chunks_per_segment),
        num_warps=4,
    )
