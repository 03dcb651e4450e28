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
devices), the alignment of every tensor it passes, the implementation and the config.

The host wrappers around those launches (allocations, views, tile arithmetic) still cost 150-300 us a call,
above the device time of the small official shapes.  So a plan given the call's ``roots`` (every tensor its
launches touch other than the scratch they allocate) records the whole call: each launch's compiled kernel,
grid and arguments, tensors as (root, offset) or (scratch region, offset).  ``LaunchPlan.replay`` then makes
the same launches for a later call with the same key, with that call's roots, one flat scratch allocation
and device pointers passed as ints; the host wrappers do not run.  Host tensor descriptors (TMA, the Gluon
kernels') are recorded by their base the same way and rebuilt around the new pointer: the launcher encodes a
descriptor from its base pointer, shape and strides at each launch.  A call that does other device work
between its launches calls ``forbid_replay``.  With ``MAMBA3_MIMO_CHECK_PLAN=1`` (the GPU tests set it)
nothing is replayed: each call runs its wrappers, every slot's kernel is checked against its full key and
every call's launches against the recorded ones.

Everything goes through the JIT under the interpreter and for CPU tensors, while launch hooks are
installed (profilers such as proton read them), and with ``MAMBA3_MIMO_JIT_LAUNCH=1`` in the environment.

Inside ``with dependent_launches():`` every kernel that declares a ``GDC`` constexpr is compiled with it on and
launched with programmatic dependent launch (``launch_pdl``, Hopper and later): its programs may be scheduled while
the previous kernel in the stream finishes, and wait for it (``triton_utils.wait_for_previous_grid``) before they
read anything it writes.  A kernel without the parameter is launched as usual, which is always safe.  The flag is
part of the compiled kernel, so a replayed call launches the same way.
"""

import contextlib
import contextvars
import inspect
import os

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction, mangle_type

# Keys hold int values (sizes): a workload with many sequence lengths would grow the cache without bound.
MAX_ENTRIES = 4096

_compiled = {}
_trailing_names = {}
# (plan key, ordinal) -> (kernel, compiled, trailing) of the launch a plan made at that position.
_plan_slots = {}
# plan key -> _CallRecord: every launch of the first whole call made under that key.
_calls = {}
_active_plan = contextvars.ContextVar("mamba3_mimo_launch_plan", default=None)
_dependent = contextvars.ContextVar("mamba3_mimo_dependent_launches", default=False)


@contextlib.contextmanager
def dependent_launches(enabled=True):
    """Launches in this block with programmatic dependent launch where the kernel declares ``GDC`` (module
    docstring).  Only for Hopper GPUs (``host_utils.dependent_launch_supported``):
    the wait is inline PTX, which the interpreter cannot run."""
    token = _dependent.set(bool(enabled))
    try:
        yield
    finally:
        _dependent.reset(token)


def _check_plans():
    return os.environ.get("MAMBA3_MIMO_CHECK_PLAN") == "1"


class LaunchPlan:
    """Context in which launches are looked up by (key, position in the block), see the module docstring.

    ``key``: hashable, and it must determine every launch the block makes; None turns the plan off.
    ``roots``: with them the block is a whole call that ``replay`` may stand in for: the tensors (or None)
    its launches read and write other than scratch it allocates, always in the same order.
    """

    __slots__ = ("key", "ordinal", "roots", "recording", "_token")

    def __init__(self, key, roots=None):
        self.key = key
        self.ordinal = 0
        self.roots = roots
        self.recording = None

    def __enter__(self):
        self._token = _active_plan.set(self if self.key is not None else None)
        return self

    def __exit__(self, exc_type, *exc):
        _active_plan.reset(self._token)
        record, self.recording = self.recording, None
        # A call that launched nothing (a test that stubs the wrappers out) must not become the key's record.
        if exc_type is None and record is not None and record.replayable and record.launches:
            known = _calls.get(self.key)
            if known is None:
                if len(_calls) >= MAX_ENTRIES:
                    _calls.clear()
                _calls[self.key] = record
            elif not known.same_launches(record):
                raise AssertionError("launch plan: a call made other launches than the recorded call of its key")
        return False

    def replay(self):
        """Launch the recorded call of this key with this call's roots; False where there is none (then the
        caller runs its own launches, recorded for the next call).  With MAMBA3_MIMO_CHECK_PLAN=1 it never
        replays: the call runs its launches and they are checked against the recorded ones on exit."""
        if self.key is None or self.roots is None or _jit_only():
            return False
        known = _calls.get(self.key)
        if known is not None and not _check_plans():
            known.run(self.roots)
            return True
        self.recording = _CallRecord(self.roots)
        return False


def forbid_replay():
    """The running call does device work other than ``launch`` (a torch op): it must not be replayed."""
    plan = _active_plan.get()
    if plan is not None and plan.recording is not None:
        plan.recording.replayable = False


class _CallRecord:
    """The launches of one call: compiled kernel, grid, and each argument as a literal, a root (by identity)
    plus a byte offset, or a scratch allocation of the call plus a byte offset.  ``run`` makes them again
    with another call's roots and one fresh scratch allocation, passing device pointers as ints."""

    SCRATCH_ALIGN = 512

    def __init__(self, roots):
        live = [x for x in roots if x is not None]
        self.root_index = {id(x): i for i, x in enumerate(roots) if x is not None}
        self.root_storages = {x.untyped_storage().data_ptr() for x in live}
        # Two roots that are one tensor would record one index for both: such a call is not recorded.
        self.replayable = len(self.root_index) == len(live)
        self.scratch = {}  # (storage base, nbytes) -> byte offset of that region in the flat scratch buffer
        self.scratch_bytes = 0
        self.device = None
        self.launches = []

    def add(self, compiled, trailing, grid, device, args):
        self.device = device
        literals = list(args)
        # (position, root index or -1 for scratch, byte offset, None or a descriptor's (shape, strides, padding))
        pointers = []
        for pos, arg in enumerate(args):
            template = None
            if _is_descriptor(arg):
                template = tuple(arg.shape), tuple(arg.strides), arg.padding
                arg = arg.base
            if not isinstance(arg, torch.Tensor):
                continue
            literals[pos] = None
            root = self.root_index.get(id(arg))
            if root is not None:
                pointers.append((pos, root, 0, template))
                continue
            storage = arg.untyped_storage()
            region = storage.data_ptr(), storage.nbytes()
            if region[0] in self.root_storages:  # a view of a root: not described by identity
                self.replayable = False
                return
            if region not in self.scratch:
                # Live storages never overlap, so a region that overlaps one seen before is memory the allocator
                # handed out again after its first tensor was freed within the call: a later lifetime, given a
                # region of its own in the flat buffer (no data passes between them).  The same block handed out
                # at the same size keeps its one region.  Refusing such calls left them unreplayed whenever the
                # allocator reused a freed block (section 57).
                self.scratch[region] = self.scratch_bytes
                self.scratch_bytes += -(-region[1] // self.SCRATCH_ALIGN) * self.SCRATCH_ALIGN
            pointers.append((pos, -1, self.scratch[region] + arg.data_ptr() - region[0], template))
        self.launches.append((compiled, trailing, _grid_xyz(grid), tuple(literals), tuple(pointers)))

    def same_launches(self, other):
        return self.scratch_bytes == other.scratch_bytes and len(self.launches) == len(other.launches) and all(
            a[0] is b[0] and a[1:] == b[1:] for a, b in zip(self.launches, other.launches))

    def run(self, roots):
        root_ptrs = [0 if x is None else x.data_ptr() for x in roots]
        scratch = None
        scratch_ptr = 0
        if self.scratch_bytes:
            scratch = torch.empty(self.scratch_bytes, dtype=torch.uint8, device=torch.device("cuda", self.device))
            scratch_ptr = scratch.data_ptr()
        stream = driver.active.get_current_stream(self.device)
        for compiled, trailing, grid_xyz, literals, pointers in self.launches:
            args = list(literals)
            for pos, root, offset, template in pointers:
                address = (scratch_ptr if root < 0 else root_ptrs[root]) + offset
                args[pos] = address if template is None else _DescriptorAt(address, *template)
            _call_compiled(compiled, trailing, grid_xyz, stream, args)
        # The scratch goes back to the caching allocator now: stream-ordered, so only work queued after these
        # launches can reuse it, as with the scratch tensors of a call that is not replayed.
        del scratch


class _Address:
    """A device pointer where the launcher asks a descriptor's base for ``data_ptr()``."""

    __slots__ = ("address",)

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


class _DescriptorAt:
    """A recorded host tensor descriptor with another base: the fields Triton's launcher reads to encode it
    (``make_tensordesc_arg``: base, shape, strides, padding; the block and layout are the compiled kernel's)."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, address, shape, strides, padding):
        self.base = _Address(address)
        self.shape, self.strides, self.padding = list(shape), list(strides), padding


def _is_descriptor(arg):
    """A host tensor descriptor (``triton.tools.tensor_descriptor`` or Gluon's): a tensor base and a block."""
    return hasattr(arg, "block_shape") and isinstance(getattr(arg, "base", None), torch.Tensor)


def _spec(arg):
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if _is_descriptor(arg):
        # What Triton specializes a descriptor on (dtype, block, layout); its base is 16-byte aligned by construction.
        return "tensordesc", mangle_type(arg)
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

    ``args``: the kernel's leading parameters, in order (tensors, host tensor descriptors, ints, None), the first
    a tensor or descriptor on the current device (CPU tensors go through the JIT); ``kwargs``: constexprs by name
    and launch options (num_warps, num_stages, maxnreg), none of them tensors.
    """
    if _dependent.get() and "GDC" in kernel.arg_names:
        kwargs = dict(kwargs, GDC=True, launch_pdl=True)
    first = args[0].base if _is_descriptor(args[0]) else args[0]
    if not (isinstance(kernel, JITFunction) and first.is_cuda) or _jit_only():
        kernel[grid](*args, **kwargs)
        return
    device = first.device.index  # the caller runs under torch.cuda.device(this device)
    plan = _active_plan.get()
    if plan is not None:
        slot = (plan.key, plan.ordinal)
        plan.ordinal += 1
        entry = _plan_slots.get(slot)
        if entry is not None and entry[0] is kernel:
            if _check_plans():
                _check_plan_entry(entry, kernel, device, args, kwargs)
            _run(entry[1], entry[2], grid, device, args)
            if plan.recording is not None:
                plan.recording.add(entry[1], entry[2], grid, device, args)
            return
    key = (kernel, device, tuple(map(_spec, args)), tuple(kwargs.items()))
    cached = _compiled.get(key)
    if cached is None:
        compiled = kernel[grid](*args, **kwargs)
        if len(_compiled) >= MAX_ENTRIES:
            _compiled.clear()
            _plan_slots.clear()
            _calls.clear()
        cached = _compiled[key] = compiled, _trailing_args(kernel, len(args), kwargs)
    else:
        _run(*cached, grid, device, args)
    if plan is not None:
        if len(_plan_slots) >= MAX_ENTRIES:
            _plan_slots.clear()
        _plan_slots[slot] = (kernel, *cached)
        if plan.recording is not None:
            plan.recording.add(*cached, grid, device, args)


def _grid_xyz(grid):
    return tuple(grid) + (1,) * (3 - len(grid))


def _call_compiled(compiled, trailing, grid_xyz, stream, args):
    """One launch through the compiled kernel's launcher (no launch hooks: ``_jit_only`` routes those to the JIT)."""
    compiled.run(*grid_xyz, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *trailing)


def _run(compiled, trailing, grid, device, args):
    _call_compiled(compiled, trailing, _grid_xyz(grid), driver.active.get_current_stream(device), args)


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
