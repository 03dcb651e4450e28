"""The log-decay tables of spans of chunks, so a scan can take a span of chunks as one chunk.

The state over a span of m chunks is the state over one chunk of m * C tokens (SPEC section 3's recurrence does
not depend on where chunks are cut): entering chunk c + m it is

    exp(sum_i da_cs[last_{c+i}]) state_c + sum_{t in the span} exp(da_cs_rev[t] + later[t]) ts[t] k~[t]^T psiv[t]

with later[t] the log decays of the span's chunks after t's own.  So a scan that only needs the states entering
every span (the end-state pass: one end state a segment) can run at chunk size m * C on these tables:

    span_da_cs[t]     = da_cs[t] + sum of da_cs[last_c'] over the span's chunks c' before t's chunk
    span_da_cs_rev[t] = da_cs_rev[t] + sum of da_cs[last_c'] over the span's chunks c' after t's chunk

(the m * C-token chunks' own cumsums), with last_c the last valid token of chunk c.  One step then takes m chunks'
rows through one update product, and the scan's fixed cost a step (docs/optimization.md section 47) is paid once
for them (section 56).
"""

import torch
import triton
import triton.language as tl

from .host_utils import cdiv
from .launch import launch
from .triton_utils import wait_for_previous_grid

BLOCK_TOKENS = 512


@triton.jit
def _span_decays_kernel(da_cs_ptr, da_cs_rev_ptr, span_da_cs_ptr, span_da_cs_rev_ptr, S,
                        C: tl.constexpr, SPAN: tl.constexpr, BLOCK_T: tl.constexpr, GDC: tl.constexpr = False):
    wait_for_previous_grid(GDC)
    row = tl.program_id(1).to(tl.int64) * S  # the (b, h) row of the [B * H, S] tables
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = t < S
    chunk = t // C
    span_first = chunk - chunk % SPAN
    before = tl.zeros([BLOCK_T], tl.float32)
    after = tl.zeros([BLOCK_T], tl.float32)
    for i in tl.static_range(SPAN):
        other = span_first + i
        # The chunk's log decay: da_cs at its last valid token (S - 1 in a partial last chunk).
        last = tl.minimum(other * C + C - 1, S - 1)
        exists = valid & (other * C < S) & (other != chunk)
        log_decay = tl.load(da_cs_ptr + row + last, mask=exists, other=0.0)
        before += tl.where(other < chunk, log_decay, 0.0)
        after += tl.where(other > chunk, log_decay, 0.0)
    tl.store(span_da_cs_ptr + row + t, tl.load(da_cs_ptr + row + t, mask=valid) + before, mask=valid)
    tl.store(span_da_cs_rev_ptr + row + t, tl.load(da_cs_rev_ptr + row + t, mask=valid) + after, mask=valid)


def span_decays(*, da_cs, da_cs_rev, chunk_size, span_chunks):
    """da_cs and da_cs_rev of chunks of ``span_chunks * chunk_size`` tokens from those of ``chunk_size``.

    Args: da_cs, da_cs_rev [B, H, S] fp32, contiguous (chunk-local cumsums; a partial last chunk ends at S - 1);
    span_chunks >= 1.  Returns span_da_cs, span_da_cs_rev [B, H, S] fp32 (new tensors; the inputs themselves with
    span_chunks = 1)."""
    if span_chunks < 1:
        raise ValueError(f"span_decays: span_chunks must be >= 1, got {span_chunks}")
    if span_chunks == 1:
        return da_cs, da_cs_rev
    B, H, S = da_cs.shape
    spans = torch.empty((2, B, H, S), device=da_cs.device, dtype=torch.float32)
    launch(_span_decays_kernel, (cdiv(S, BLOCK_TOKENS), B * H), da_cs, da_cs_rev, spans[0], spans[1], S,
           C=chunk_size, SPAN=span_chunks, BLOCK_T=BLOCK_TOKENS, num_warps=4)
    return spans[0], spans[1]
