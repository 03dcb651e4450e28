"""Triton kernels for the Mamba-3 MIMO state-space layer.

``mamba3_mimo_bwd_fwd_kernel`` is the combined backward's first pass (see SPEC
section 2 and docs/api.md).
"""

from .api import bwd_fwd, mamba3_mimo_bwd_fwd_kernel

__all__ = ["mamba3_mimo_bwd_fwd_kernel", "bwd_fwd"]
__version__ = "0.1.0"
