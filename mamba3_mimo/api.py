"""Public entry of the bwd_fwd operator: validate, normalize, dispatch.

Nothing here computes; every check runs before any kernel launches and no
caller tensor is modified (normalization makes copies only where a tensor is
not already contiguous or not in the dtype the kernels read).
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch
import triton.language as tl

from .ops.host_utils import cdiv, next_power_of_2
from .ops.launch import LaunchPlan
from .ops.production import production_bwd_fwd
from .ops.stage0 import stage0_bwd_fwd

IMPLEMENTATIONS = ("production", "stage0")
HALF_DTYPES = (torch.float16, torch.bfloat16)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUTPUT_DTYPES = ACTIVATION_DTYPES
# Rows of the folded (token, rank) chunk tile; the score tile is ROWS x ROWS.
MAX_CHUNK_ROWS = 256
MAX_N = 512
_POISON_OUTPUTS = False  # test hook: NaN-fill the outputs before the launch so unwritten elements fail


@dataclass(frozen=True)
class Problem:
    B: int
    S: int
    H: int
    G: int
    R: int
    N: int
    P: int
    RD: int
    chunk_size: int
    nch: int
    has_z: bool
    has_d: bool


def interpreter_enabled():
    """Whether this process's kernels run in the Triton interpreter.

    Triton decides at import time (TRITON_INTERPRET set before triton is
    imported); reading the variable now would miss a late change, so ask the
    kernel object itself.
    """
    from triton.runtime.interpreter import InterpretedFunction

    from .ops.chunk_output import _chunk_output_kernel

    return isinstance(_chunk_output_kernel, InterpretedFunction)


def _check_shape(name, tensor, expected):
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {list(expected)}, got {list(tensor.shape)}")


def _check_rank(name, tensor, rank, layout):
    if tensor.dim() != rank:
        raise ValueError(f"{name}: expected a {rank}-d tensor {layout}, got shape {list(tensor.shape)}")


def _check_float(name, tensor, allowed=None):
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")
    if allowed is not None and tensor.dtype not in allowed:
        names = ", ".join(str(dt).replace("torch.", "") for dt in allowed)
        raise TypeError(f"{name}: expected dtype in ({names}), got {tensor.dtype}")


# Problems already validated, by (shape, dtype, device) of every tensor and the other arguments: the checks
# depend on nothing else, and a call repeats its predecessor's in training (~50 us of host time a call).
_VALIDATED = {}
MAX_VALIDATED = 1024


def validate(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
             mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype):
    """Check every constraint of SPEC section 5; return the problem sizes."""
    return _validate(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
                     mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype)[0]


def _validate(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
              mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype):
    """``validate``, and the call's signature (every tensor's shape, dtype and device, the ints and the output
    dtype: a hashable), or None where it does not hash."""
    required = (dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum)
    optional = (mimo_z, d, z)
    key = None
    if all(isinstance(x, torch.Tensor) for x in required) and all(x is None or isinstance(x, torch.Tensor)
                                                                    for x in optional) \
            and type(chunk_size) is int and type(rotary_dim_divisor) is int and output_dtype in OUTPUT_DTYPES:
        # CPU tensors are accepted only under the interpreter, so that answer is part of the key.
        key = (tuple(None if x is None else (x.shape, x.dtype, x.device) for x in required + optional), chunk_size,
               rotary_dim_divisor, output_dtype, q.is_cuda or interpreter_enabled())
        try:
            problem = _VALIDATED.get(key)
        except TypeError:  # symbolic sizes (torch.compile's fake tensors) do not hash: check every time
            key, problem = None, None
        if problem is not None:
            return problem, key
    problem = _check_problem(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
                             segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype)
    if key is not None:
        if len(_VALIDATED) >= MAX_VALIDATED:
            _VALIDATED.clear()
        _VALIDATED[key] = problem
    return problem, key


def _check_problem(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
                   mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype):
    named = dict(dout=dout, q=q, k=k, v=v, q_bias=q_bias, k_bias=k_bias, mimo_v=mimo_v, mimo_o=mimo_o,
                 angles=angles, da_cs=da_cs, da_cs_rev=da_cs_rev, dt=dt, trap=trap, segsum=segsum)
    for name, tensor in named.items():
        if tensor is None:
            raise ValueError(f"{name} is required, got None")
    for name, tensor in dict(named, mimo_z=mimo_z, d=d, z=z).items():
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if (mimo_z is None) != (z is None):
        given, missing = ("mimo_z", "z") if z is None else ("z", "mimo_z")
        raise ValueError(f"the SiLU gate needs mimo_z and z together: {given} was given without {missing}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")
    if isinstance(rotary_dim_divisor, bool) or not isinstance(rotary_dim_divisor, int) or rotary_dim_divisor < 1:
        raise ValueError(f"rotary_dim_divisor: expected an int >= 1, got {rotary_dim_divisor!r}")
    if output_dtype not in OUTPUT_DTYPES:
        raise TypeError(f"output_dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {output_dtype!r}")

    _check_rank("q", q, 5, "[B, S, R, G, N]")
    B, S, R, G, N = q.shape
    _check_rank("dout", dout, 4, "[B, S, H, P]")
    H, P = dout.shape[2], dout.shape[3]
    for size_name, size in dict(B=B, S=S, R=R, G=G, N=N, H=H, P=P).items():
        if size < 1:
            raise ValueError(f"{size_name} must be >= 1, got {size} (q {list(q.shape)}, dout {list(dout.shape)})")
    if H % G != 0:
        raise ValueError(f"H % G != 0: H={H} heads (from dout) cannot be grouped over G={G} q/k heads")
    if N % 2 != 0:
        raise ValueError(f"N must be even for rotate-half, got N={N}")
    if N > MAX_N:
        raise ValueError(f"N={N} is not supported (at most {MAX_N})")
    RD = N // rotary_dim_divisor
    if RD > N // 2:
        raise ValueError(f"rotary dim N // rotary_dim_divisor = {RD} exceeds N/2 = {N // 2}")
    rows = next_power_of_2(chunk_size) * next_power_of_2(R)
    if rows > MAX_CHUNK_ROWS:
        raise ValueError(f"chunk_size * next_pow2(R) = {chunk_size} * {next_power_of_2(R)} = {rows} "
                         f"exceeds {MAX_CHUNK_ROWS}: use a smaller chunk_size")
    nch = cdiv(S, chunk_size)
    # Offsets inside one batch element are int32 in the kernels (int64 per-element index tiles
    # would double their registers); the batch/head bases are int64.
    per_batch = dict(q=S * R * G * N, v=S * H * P, angles=S * H * RD, states=H * nch * N * P, qk_dot=H * S * R * R)
    for name, elements in per_batch.items():
        if elements >= 2 ** 31:
            raise ValueError(f"{name}: one batch element spans {elements} elements, more than the 2^31 - 1 "
                             "that the kernels index with int32; split the sequence")

    seq_hp = (B, S, H, P)
    disc = (B, H, S)
    expected = dict(dout=seq_hp, q=(B, S, R, G, N), k=(B, S, R, G, N), v=seq_hp,
                    q_bias=(H, R, N), k_bias=(H, R, N), mimo_v=(H, R, P), mimo_o=(H, R, P),
                    angles=(B, S, H, RD), da_cs=disc, da_cs_rev=disc, dt=disc, trap=disc,
                    segsum=(B, H, nch, chunk_size, chunk_size))
    if z is not None:
        expected.update(mimo_z=(H, R, P), z=seq_hp)
    if d is not None:
        expected.update(d=(H,))
    tensors = dict(named, mimo_z=mimo_z, d=d, z=z)
    for name, shape in expected.items():
        _check_rank(name, tensors[name], len(shape), "")
        _check_shape(name, tensors[name], shape)
    for name in ("dout", "q", "k", "v", "z", "trap"):
        if tensors[name] is not None:
            _check_float(name, tensors[name], ACTIVATION_DTYPES)
    for name in ("q_bias", "k_bias", "mimo_v", "mimo_o", "mimo_z", "d", "angles", "da_cs", "da_cs_rev", "dt",
                 "segsum"):
        if tensors[name] is not None:
            _check_float(name, tensors[name])

    device = q.device
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {device}: all tensors must share a device")
    if device.type == "cuda":
        pass
    elif device.type == "cpu" and interpreter_enabled():
        pass
    else:
        raise NotImplementedError(
            f"tensors on {device}: the Triton kernels run on CUDA devices, or on the CPU when TRITON_INTERPRET=1 "
            "is set; there is no silent fallback to the PyTorch reference")
    return Problem(B=B, S=S, H=H, G=G, R=R, N=N, P=P, RD=RD, chunk_size=chunk_size, nch=nch,
                   has_z=z is not None, has_d=d is not None)


def dot_operands(activation_dtypes, device):
    """(tl dtype, input_precision) of the kernels' matrix products for these activations.

    fp32 activations use exact fp32 products (the 1e-5 contract rules out tf32); half
    activations feed the tensor cores in bf16 (if any is bf16, for its range) or fp16.  The
    interpreter miscomputes bf16 products, so there they run in fp32.
    """
    if all(dt == torch.float32 for dt in activation_dtypes):
        return tl.float32, "ieee"
    if torch.bfloat16 in activation_dtypes:
        if device.type == "cpu":
            return tl.float32, "ieee"
        return tl.bfloat16, "ieee"
    return tl.float16, "ieee"


def kernel_output_dtype(output_dtype, device):
    """dtype the kernels write: the output dtype, except bf16 on the CPU.

    The Triton 3.6 interpreter truncates fp32 -> bf16 instead of rounding to
    nearest, so on the CPU path bf16 outputs are written in fp32 and rounded by
    torch.  No effect on the GPU path.
    """
    return torch.float32 if output_dtype == torch.bfloat16 and device.type == "cpu" else output_dtype


def _contiguous(x, dtype=None):
    if x is None:
        return None
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    return x.contiguous()


def launch_plan_key(signature, impl, config, passed):
    """Key of a call's launches (ops/launch.py ``LaunchPlan``), or None without a signature.

    Every launch follows from the call's signature (shapes, dtypes, devices, ints), the implementation (the
    function that launches, so that a stub or wrapper put in its place makes another key and is neither
    replayed over nor recorded for the real one), the config and the 16-byte alignment of the tensors the
    kernels get (``passed``, None where absent); the outputs and scratch are fresh allocations, always aligned.
    """
    if signature is None:
        return None
    return signature, impl, config, tuple(x is not None and x.data_ptr() % 16 == 0 for x in passed)


def bwd_fwd(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
            mimo_z=None, d=None, z=None, chunk_size=16, rotary_dim_divisor=4, output_dtype=torch.float32,
            impl="production", config=None):
    """``mamba3_mimo_bwd_fwd_kernel`` with a choice of implementation ("production" or "stage0")."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl: expected one of {IMPLEMENTATIONS}, got {impl!r}")
    prob, signature = _validate(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap,
                                segsum, mimo_z, d, z, chunk_size, rotary_dim_divisor, output_dtype)
    B, S, H, R, N, P, nch = prob.B, prob.S, prob.H, prob.R, prob.N, prob.P, prob.nch
    f32 = torch.float32
    activations = [x.dtype for x in (dout, q, k, v, z) if x is not None]
    dot_dtype, dot_precision = dot_operands(activations, q.device)
    tensors = dict(
        q=_contiguous(q), k=_contiguous(k), v=_contiguous(v), dout=_contiguous(dout), z=_contiguous(z),
        angles=_contiguous(angles, f32), q_bias=_contiguous(q_bias, f32), k_bias=_contiguous(k_bias, f32),
        mimo_v=_contiguous(mimo_v, f32), mimo_o=_contiguous(mimo_o, f32), mimo_z=_contiguous(mimo_z, f32),
        d=_contiguous(d, f32), da_cs=_contiguous(da_cs, f32), da_cs_rev=_contiguous(da_cs_rev, f32),
        dt=_contiguous(dt, f32), trap=_contiguous(trap),
    )
    kernel_dtype = kernel_output_dtype(output_dtype, q.device)
    out = dict(device=q.device, dtype=kernel_dtype)
    outputs = dict(
        states=torch.empty((B, H, nch, N, P), **out),
        qk_dot=torch.empty((B, H, S, R, R), **out),
        dmimo_o=torch.empty((B, H, R, P), **out),
        dmimo_z=torch.empty((B, H, R, P), **out) if prob.has_z else None,
        dz=torch.empty((B, S, H, P), **out) if prob.has_z else None,
    )
    if _POISON_OUTPUTS:
        for x in outputs.values():
            if x is not None:
                x.fill_(float("nan"))
    segsum = _contiguous(segsum, f32) if impl == "stage0" else None  # the production kernels derive it
    run = production_bwd_fwd if impl == "production" else stage0_bwd_fwd
    plan_key = launch_plan_key(signature, run, config, (*tensors.values(), segsum)) if q.is_cuda else None
    # A production call is replayed whole when its plan key has been seen: the launches of the first such call
    # with this call's tensors (roots, in a fixed order) and one fresh scratch allocation (ops/launch.py).
    roots = (*tensors.values(), *outputs.values()) if impl == "production" else None
    with torch.cuda.device(q.device) if q.is_cuda else nullcontext(), LaunchPlan(plan_key, roots) as plan:
        if impl == "production":
            if not plan.replay():
                run(**tensors, **outputs, chunk_size=chunk_size, dot_dtype=dot_dtype, dot_precision=dot_precision,
                    config=config)
        else:
            run(**tensors, **outputs, segsum=segsum, chunk_size=chunk_size, dot_dtype=dot_dtype,
                dot_precision=dot_precision)
    results = tuple(outputs[name] for name in ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz"))
    if kernel_dtype != output_dtype:
        results = tuple(None if x is None else x.to(output_dtype) for x in results)
    return results


def mamba3_mimo_bwd_fwd_kernel(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt,
                               trap, segsum, mimo_z=None, d=None, z=None, chunk_size=16, rotary_dim_divisor=4,
                               output_dtype=torch.float32):
    """Mamba-3 MIMO combined backward, first pass (SPEC section 2).

    Shapes (B batch, S sequence, R rank, G q/k heads, N q/k dim, H heads, P value dim,
    C = chunk_size, nch = ceil(S / C), RD = N // rotary_dim_divisor):
        dout, v, z: [B, S, H, P]          q, k: [B, S, R, G, N]
        q_bias, k_bias: [H, R, N]         mimo_v, mimo_o, mimo_z: [H, R, P]
        angles: [B, S, H, RD]             da_cs, da_cs_rev, dt, trap: [B, H, S]
        segsum: [B, H, nch, C, C]         d: [H]
    Returns (states [B, H, nch, N, P], qk_dot [B, H, S, R, R], dmimo_o [B, H, R, P],
    dmimo_z [B, H, R, P] or None, dz [B, S, H, P] or None), all in ``output_dtype``.

    ``segsum`` is checked but not read by the production kernels: they derive
    ``da_cs[i] - da_cs[j]`` themselves, which is what segsum holds by definition.
    """
    return bwd_fwd(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
                   mimo_z=mimo_z, d=d, z=z, chunk_size=chunk_size, rotary_dim_divisor=rotary_dim_divisor,
                   output_dtype=output_dtype, impl="production")
