"""Integer helpers for the host side of the launches.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions in Triton 3.6: each host call
goes through a wrapper that unwraps its arguments, a few microseconds that a bwd_fwd call paid
~36 times (benchmarks/host_profile.py).  These are the plain-Python equivalents.
"""


def cdiv(a, b):
    """ceil(a / b) for positive ints."""
    return -(-a // b)


def next_power_of_2(n):
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def compiled_for_gpu(tensor):
    """True where the kernels run compiled for the GPU, False under the Triton interpreter (CPU tensors).

    Kernels take GPU-only paths (inline PTX) on this flag; ``benchmarks/aot_report.py`` sets it to
    compile for sm_90 from CPU tensors.
    """
    return tensor.is_cuda
