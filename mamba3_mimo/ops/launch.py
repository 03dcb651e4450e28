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

Building that key is itself 0.1-0.3 us an argument (about 5 us a launch on the H200 machine, where a call
took 24-30 us less without it: benchmarks/results/2026-12-04_h200_host_3162298.log).
Inside ``with LaunchPlan(key):`` the i-th launch instead looks up (key, i): a call whose ``key`` determines
every launch it makes (which kernels, in which order, with which specializations) replays the compiled
kernels the first such call used.  ``api.bwd_fwd`` keys a call by its validated signature (shapes, dtypes,
devices), the alignment of every tensor it passes, the implementation and the config.  With
``MAMBA3_MIMO_CHECK_PLAN=1`` every replayed launch is checked against the full key (the GPU tests set it).

Everything goes through the JIT under the interpreter and for CPU tensors, while launch hooks are
installed (profilers such as proton read them), and with ``MAMBA3_MIMO_JIT_LAUNCH=1`` in the environment.
"""

import contextvars
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
# (plan key, ordinal) -> (kernel, compiled, trailing) of the launch a plan made at that position.
_plan_slots = {}
_active_plan = contextvars.ContextVar("mamba3_mimo_launch_plan", default=None)


class LaunchPlan:
    """Context in which launches are looked up by (key, position in the block), see the module docstring.

    ``key``: hashable, and it must determine every launch the block makes; None turns the plan off.
    """

    __slots__ = ("key", "ordinal", "_token")

    def __init__(self, key):
        self.key = key
        self.ordinal = 0

    def __enter__(self):
        self._token = _active_plan.set(self if self.key is not None else None)
        return self

    def __exit__(self, *exc):
        _active_plan.reset(self._token)
        return False


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
    plan = _active_plan.get()
    if plan is not None:
        slot = (plan.key, plan.ordinal)
        plan.ordinal += 1
        entry = _plan_slots.get(slot)
        if entry is not None and entry[0] is kernel:
            if os.environ.get("MAMBA3_MIMO_CHECK_PLAN") == "1":
                _check_plan_entry(entry, kernel, device, args, kwargs)
            _run(entry[1], entry[2], grid, device, args)
            return
    key = (kernel, device, tuple(map(_spec, args)), tuple(kwargs.items()))
    cached = _compiled.get(key)
    if cached is None:
        compiled = kernel[grid](*args, **kwargs)
        if len(_compiled) >= MAX_ENTRIES:
            _compiled.clear()
            _plan_slots.clear()
        cached = _compiled[key] = compiled, _trailing_args(kernel, len(args), kwargs)
    else:
        _run(*cached, grid, device, args)
    if plan is not None:
        if len(_plan_slots) >= MAX_ENTRIES:
            _plan_slots.clear()
        _plan_slots[slot] = (kernel, *cached)


def _run(compiled, trailing, grid, device, args):
    grid_x, grid_y, grid_z = tuple(grid) + (1,) * (3 - len(grid))
    compiled.run(grid_x, grid_y, grid_z, driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *trailing)


def _check_plan_entry(entry, kernel, device, args, kwargs):
    cached = _compiled.get((kernel, device, tuple(map(_spec, args)), tuple(kwargs.items())))
    if cached is None or cached[0] is not entry[1]:
        raise AssertionError(f"launch plan: {kernel.fn.__name__} replayed a kernel its full key does not select")


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
