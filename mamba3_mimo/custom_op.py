"""``torch.ops.mamba3_mimo.bwd_fwd``: the operator registered with torch.library.

The Python entry stays ``mamba3_mimo_bwd_fwd_kernel`` (a plain call of ``api.bwd_fwd``); this
registration is for graph users: ``torch.compile(fullgraph=True)`` traces through the op with the
fake implementation below (output shapes and dtypes only) and calls the Triton kernels at run
time, and ``torch.library.opcheck`` checks the registration.

Schema (importing ``mamba3_mimo`` registers it)::

    mamba3_mimo::bwd_fwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor q_bias, Tensor k_bias,
        Tensor mimo_v, Tensor mimo_o, Tensor angles, Tensor da_cs, Tensor da_cs_rev, Tensor dt,
        Tensor trap, Tensor segsum, Tensor? mimo_z=None, Tensor? d=None, Tensor? z=None,
        int chunk_size=16, int rotary_dim_divisor=4, ScalarType output_dtype=float32,
        str impl="production") -> (Tensor states, Tensor qk_dot, Tensor dmimo_o,
        Tensor? dmimo_z, Tensor? dz)

Optional outputs: the schema declares ``dmimo_z`` and ``dz`` as ``Tensor?`` and the op returns
None for them without the gate, exactly like the Python API.  ``torch.library.custom_op`` cannot
infer such a schema from type hints (its return types are Tensor, int, float, bool and lists of
Tensor only), so the schema string is given explicitly; with it, torch 2.13 passes ``opcheck``
(schema, fake tensor, AOT dispatch with dynamic shapes) and compiles with ``fullgraph=True``
under the eager, aot_eager and inductor backends.  Whether the outputs are None is decided by
whether ``z`` is None, which is static for a traced graph.

Both the real and the fake implementation call ``api.validate``, so a bad call raises the same
ValueError / TypeError / NotImplementedError as the API, at trace time under torch.compile.
The op has no autograd formula (it is itself a backward pass); its outputs never require grad.
"""

from __future__ import annotations

import torch

from . import api

OP_NAME = "mamba3_mimo::bwd_fwd"
SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor q_bias, Tensor k_bias, Tensor mimo_v, "
    "Tensor mimo_o, Tensor angles, Tensor da_cs, Tensor da_cs_rev, Tensor dt, Tensor trap, "
    "Tensor segsum, Tensor? mimo_z=None, Tensor? d=None, Tensor? z=None, int chunk_size=16, "
    "int rotary_dim_divisor=4, ScalarType output_dtype=float32, str impl=\"production\") "
    "-> (Tensor, Tensor, Tensor, Tensor?, Tensor?)"
)


@torch.library.custom_op(OP_NAME, mutates_args=(), schema=SCHEMA)
def _bwd_fwd_op(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
                mimo_z=None, d=None, z=None, chunk_size=16, rotary_dim_divisor=4,
                output_dtype=torch.float32, impl="production"):
    # api.bwd_fwd validates, allocates fresh outputs and leaves every input untouched.
    return api.bwd_fwd(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
                       segsum, mimo_z=mimo_z, d=d, z=z, chunk_size=chunk_size,
                       rotary_dim_divisor=rotary_dim_divisor, output_dtype=output_dtype, impl=impl)


@_bwd_fwd_op.register_fake
def _bwd_fwd_fake(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
                  mimo_z=None, d=None, z=None, chunk_size=16, rotary_dim_divisor=4,
                  output_dtype=torch.float32, impl="production"):
    if impl not in api.IMPLEMENTATIONS:
        raise ValueError(f"impl: expected one of {api.IMPLEMENTATIONS}, got {impl!r}")
    prob = api.validate(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
                        segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype)
    B, S, H, R, N, P, nch = prob.B, prob.S, prob.H, prob.R, prob.N, prob.P, prob.nch
    out = dict(device=q.device, dtype=output_dtype)
    states = torch.empty((B, H, nch, N, P), **out)
    qk_dot = torch.empty((B, H, S, R, R), **out)
    dmimo_o = torch.empty((B, H, R, P), **out)
    if not prob.has_z:
        return states, qk_dot, dmimo_o, None, None
    return states, qk_dot, dmimo_o, torch.empty((B, H, R, P), **out), torch.empty((B, S, H, P), **out)


bwd_fwd_op = torch.ops.mamba3_mimo.bwd_fwd
"""The registered op (an ``OpOverloadPacket``); same arguments and outputs as ``api.bwd_fwd``
without ``config``."""
