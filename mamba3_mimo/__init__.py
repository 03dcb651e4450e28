"""Triton kernels for the Mamba-3 MIMO state-space layer.

``mamba3_mimo_bwd_fwd_kernel`` is the combined backward's first pass (see SPEC
section 2 and docs/api.md).  Importing the package also registers the operator
``torch.ops.mamba3_mimo.bwd_fwd`` (``custom_op.py``) for torch.compile and graph users.
"""

from . import custom_op  # noqa: F401  (registers torch.ops.mamba3_mimo.bwd_fwd)
from .api import bwd_fwd, mamba3_mimo_bwd_fwd_kernel

__all__ = ["mamba3_mimo_bwd_fwd_kernel", "bwd_fwd"]
__version__ = "0.1.0"
