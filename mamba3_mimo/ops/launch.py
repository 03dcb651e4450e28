"""Triton launches without the JIT's per-call argument binding.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument, builds and hashes a cache
key and fills launch metadata on each call: 13-28 us of host time a launch on the H200 machine, where
the compiled kernel's own launcher takes 5-9 us (benchmarks/host_profile.py).  A bwd_fwd call launches
six kernels; on the smaller shapes its host time exceeded its device time, so eager calls waited on
the host.

``launch(kernel, grid, *args, **constexprs)`` keeps the compiled kernel of each specialization and calls
its launcher directly.  The key holds everything Triton specializes on: each tensor's dtype and 16-byte
alignment, each other argument's value, the keyword constexprs and launch options, and the device.  A
call Triton would compile differently therefore misses and goes through the JIT, which compiles (or
finds) and launches it; its compiled kernel is kept for the next call with the same key.

Everything goes through the JIT under the interpreter and for CPU tensors, while launch hooks are
installed (profilers such as proton read them), and with ``MAMBA3_MIMO_JIT_LAUNCH=1`` in the environment.
"""

import inspect
import os

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# Keys hold int values (sizes): a workload with many sequence lengths would grow the cache without bound.
MAX_ENTRIES = 4096

_compiled = {}
_trailing_names = {}


def _spec(arg):
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, float):
        return float  # Triton does not specialize on float values
    if isinstance(arg, bool):
        return bool, arg  # True == 1 as a dict key, but Triton types a bool i1 and an int 1 a constant
    return arg


def _jit_only():
    return (os.environ.get("MAMBA3_MIMO_JIT_LAUNCH") == "1" or knobs.runtime.launch_enter_hook.calls
            or knobs.runtime.launch_exit_hook.calls)


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, through the compiled kernel's launcher once it is known.

    ``args``: the kernel's leading parameters, in order (tensors, ints, None), the first a tensor on the
    current device (CPU tensors go through the JIT); ``kwargs``: constexprs by name and launch options
    (num_warps, num_stages, maxnreg), none of them tensors.
    """
    if not (isinstance(kernel, JITFunction) and args[0].is_cuda) or _jit_only():
        kernel[grid](*args, **kwargs)
        return
    device = args[0].device.index  # the caller runs under torch.cuda.device(this device)
    key = (kernel, device, tuple(map(_spec, args)), tuple(kwargs.items()))
    compiled = _compiled.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if len(_compiled) >= MAX_ENTRIES:
            _compiled.clear()
        _compiled[key] = compiled, _trailing_args(kernel, len(args), kwargs)
        return
    compiled, trailing = compiled
    grid_x, grid_y, grid_z = tuple(grid) + (1,) * (3 - len(grid))
    compiled.run(grid_x, grid_y, grid_z, driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *trailing)


def _trailing_args(kernel, n_positional, kwargs):
    """Values of the parameters after the positional ones: the constexprs, from kwargs or defaults."""
    if kernel not in _trailing_names:
        _trailing_names[kernel] = list(inspect.signature(kernel.fn).parameters.values())
    trailing = []
    for param in _trailing_names[kernel][n_positional:]:
        value = kwargs.get(param.name, param.default)
        if value is inspect.Parameter.empty:
            raise TypeError(f"{kernel.fn.__name__}: parameter {param.name} was not given")
        if isinstance(value, torch.Tensor):
            raise TypeError(f"{kernel.fn.__name__}: pass tensor {param.name} positionally")
        trailing.append(value)
    return tuple(trailing)
