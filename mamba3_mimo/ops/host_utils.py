"""Helpers for the host side of the launches: integer arithmetic, the kernels' dtype and unit choices.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton 3.6: each host call
goes through a wrapper that unwraps its arguments, a few microseconds that a bwd_fwd call paid
~36 times (benchmarks/host_profile.py).  These are the plain-Python equivalents.
"""

import functools
import os

import torch
import triton.language as tl


def cdiv(a, b):
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def next_power_of_2(n):
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def rotation_math_dtype(dot_dtype, half_rotation):
    """tl dtype of the kernels' q / k bias add and rotation: the products' dtype where ``half_rotation`` asks for it
    and the products take 16-bit operands (two elements a register, one rounding an operation), else fp32."""
    return dot_dtype if half_rotation and dot_dtype in (tl.bfloat16, tl.float16) else tl.float32


# libdevice's exp where the products are fp32 (``precise_exp``), for the one GPU failure of fp32 inputs
# (docs/optimization.md section 34).  On the GPU it moved no accuracy margin over 30 seeds and that failure is the fp32
# dual benchmark's tail (section 36), so it stays off; MAMBA3_MIMO_FP32_PRECISE_EXP=1 turns it on.
FP32_PRECISE_EXP = os.environ.get("MAMBA3_MIMO_FP32_PRECISE_EXP") == "1"


def precise_exp(dot_dtype, tensor):
    """Whether the kernels take libdevice's exp (``triton_utils.exp_fp32``): fp32 products, compiled for the GPU,
    and ``FP32_PRECISE_EXP`` on.  Half-precision paths keep ``tl.exp``, whose error is far below their rounding."""
    return FP32_PRECISE_EXP and dot_dtype == tl.float32 and compiled_for_gpu(tensor)


def sigmoid_units(activations):
    """``triton_utils.silu_and_grad``'s flags for a kernel that reads ``activations``: on the GPU the approximate
    units for 16-bit activations, libdevice's exp and an IEEE division for fp32 ones (the approximate units' error
    grows with |u|: emulated, 1.32x the fp32 reference's dPhi MERE at the median; docs/optimization.md sections 35-36);
    neither (``tl.sigmoid``) under the interpreter."""
    gpu = compiled_for_gpu(activations)
    fp32 = activations.dtype == torch.float32
    return dict(FAST_SIGMOID=gpu and not fp32, PRECISE_SIGMOID=gpu and fp32)


def compiled_for_gpu(tensor):
    """True where the kernels run compiled for the GPU, False under the Triton interpreter (CPU tensors).

    Kernels take GPU-only paths (inline PTX) on this flag; ``benchmarks/aot_report.py`` sets it to
    compile for sm_90 from CPU tensors.
    """
    return tensor.is_cuda


def compiled_for_hopper(tensor):
    """True where the kernels run compiled for a Hopper GPU (compute capability 9.x): where the Gluon kernels (wgmma,
    TMA) can run."""
    return compiled_for_gpu(tensor) and _capability_major(tensor.device.index) == 9


def dependent_launch_supported(tensor):
    """True where a call on ``tensor``'s device may use programmatic dependent launch (``launch.dependent_launches``):
    compiled for a Hopper GPU, the only kind it has been built for and checked on.  Later GPUs have the instructions
    too, but graph capture with the launch attribute is reported to fail on sm_120 (sgl-project/sglang#18596), and
    nothing here has run there."""
    return compiled_for_hopper(tensor)


@functools.lru_cache(maxsize=None)
def _capability_major(device_index):
    return torch.cuda.get_device_capability(device_index)[0]


def check_raw_y_scratch(who, raw_y, raw_y_scale, block_p):
    """True for the fp16 raw_y scratch with its row scales, False for fp32; ValueError for anything else.

    raw_y: [B, H, S, R, P]; the fp16 one comes with raw_y_scale [B, H, S, R, cdiv(P, block_p)] fp32, one inverse
    scale per (row, P tile of ``block_p`` columns, a power of two), and the fp32 one without.
    """
    if raw_y.dtype not in (torch.float32, torch.float16):
        raise ValueError(f"{who}: raw_y is fp32, or fp16 with raw_y_scale; got {raw_y.dtype}")
    if raw_y.dtype == torch.float32:
        if raw_y_scale is not None:
            raise ValueError(f"{who}: raw_y_scale goes with an fp16 raw_y only")
        return False
    if not block_p or block_p & (block_p - 1):
        raise ValueError(f"{who}: raw_y_scale's P tile is a power of two; got {block_p}")
    B, H, S, R, P = raw_y.shape
    want = (B, H, S, R, cdiv(P, block_p))
    if raw_y_scale is None or tuple(raw_y_scale.shape) != want or raw_y_scale.dtype != torch.float32:
        got = None if raw_y_scale is None else (tuple(raw_y_scale.shape), raw_y_scale.dtype)
        raise ValueError(f"{who}: fp16 raw_y needs raw_y_scale of shape {want}, fp32; got {got}")
    return True


_TL_TABLE_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def rotation_source(who, tensor, cos_angles, sin_angles, angles, table_dtype):
    """Where a rotating kernel takes its cos / sin: the ``token_tables`` tables (cos_angles, sin_angles), or, with
    ``angles`` and a 16-bit ``table_dtype``, the angles themselves, their cos / sin computed in the kernel as those
    tables would hold them (``triton_utils.table_cos_sin``; ``ScanConfig.angles_in_kernels``).  ValueError for any
    other mix.  Returns the kernel's tensors and constants: cos_angles, sin_angles (both the angles in the second
    form), RD, FROM_ANGLES, TABLE_DTYPE, FAST_TRIG (as ``token_tables`` chooses it for the tables), and table_dtype,
    the torch dtype of the tables the kernel reads or stands in for."""
    if angles is None:
        if cos_angles is None or sin_angles is None or table_dtype is not None:
            raise ValueError(f"{who}: pass the cos / sin tables, or angles with their table_dtype")
        return dict(cos_angles=cos_angles, sin_angles=sin_angles, RD=cos_angles.shape[3], FROM_ANGLES=False,
                    TABLE_DTYPE=tl.float32, FAST_TRIG=False, table_dtype=cos_angles.dtype)
    if cos_angles is not None or sin_angles is not None:
        raise ValueError(f"{who}: angles replace the cos / sin tables; pass one or the other")
    if table_dtype not in _TL_TABLE_DTYPES:
        raise ValueError(f"{who}: angles take a 16-bit table_dtype (the tables' values they stand for), got "
                         f"{table_dtype}")
    if angles.dtype != torch.float32 or angles.dim() != 4:
        raise ValueError(f"{who}: angles are [B, S, H, RD] fp32, got {tuple(angles.shape)} {angles.dtype}")
    return dict(cos_angles=angles, sin_angles=angles, RD=angles.shape[3], FROM_ANGLES=True,
                TABLE_DTYPE=_TL_TABLE_DTYPES[table_dtype], FAST_TRIG=compiled_for_gpu(tensor), table_dtype=table_dtype)
