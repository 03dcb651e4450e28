"""Shared test setup: device choice, output poisoning and the kernel-vs-reference check.

Without CUDA the kernels run in the Triton interpreter, which must be switched on before
anything imports triton; pytest imports this file first, so it is done here at import time.
"""

import dataclasses
import itertools
import os
import zlib

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import mamba3_mimo.api as api  # noqa: E402
from mamba3_mimo.accuracy import check_outputs, judge_with_redraws  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.reference import bwd_fwd_reference  # noqa: E402

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (the CPU runs use the interpreter)")


@pytest.fixture(scope="session")
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def poison_outputs(monkeypatch):
    """NaN-fill every output the API allocates, so an element no kernel writes fails the check."""
    monkeypatch.setattr(api, "_POISON_OUTPUTS", True)


def to_device(inputs, device):
    """The keyword arguments of ``make_inputs`` with every tensor moved to ``device``."""
    return {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in inputs.items()}


def spy_gate_grads(monkeypatch):
    """Each gate_grads launch (the Triton or the Gluon kernel) of the calls that follow, in a list: (its name,
    whether it adds the D skip)."""
    from mamba3_mimo.ops import gluon_gate_grads, production

    gates = []
    for module, name in ((production, "gate_grads"), (gluon_gate_grads, "gluon_gate_grads")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda _kernel=kernel, _name=name, **kw: (
            gates.append((_name, kw.get("d") is not None)), _kernel(**kw))[1])
    return gates


def assert_knob_inert(inputs, base, knob, values=(False, True), output_dtype=torch.bfloat16):
    """Production calls on ``inputs`` with ``base`` and ``knob`` at each of ``values`` (a switch off and on) give the
    same outputs bit for bit (a knob that routes to a kernel where it applies, checked where it does not)."""
    outputs = [api.bwd_fwd(**inputs, output_dtype=output_dtype, impl="production",
                           config=dataclasses.replace(base, **{knob: value})) for value in values]
    for plain, with_knob in zip(*outputs):
        assert (plain is None) == (with_knob is None)
        if plain is not None:
            assert torch.equal(plain, with_knob)


def spy_on_replays(monkeypatch, *, fresh=True):
    """Count whole-call replays (``launch._CallRecord.run``) in the list returned; with ``fresh`` no call is recorded
    yet, so the next one records.  The plan check is off: it runs the wrappers, which a replay skips."""
    from mamba3_mimo.ops import launch as launch_module

    monkeypatch.delenv("MAMBA3_MIMO_CHECK_PLAN", raising=False)
    if fresh:
        monkeypatch.setattr(launch_module, "_calls", {})
    replays = []
    run = launch_module._CallRecord.run
    monkeypatch.setattr(launch_module._CallRecord, "run", lambda self, roots: (replays.append(1), run(self, roots)))
    return replays


def assert_replay_equals_jit(replayed, through_jit):
    """A replayed call's outputs are written (no NaN of the poisoned outputs left) and bitwise the JIT call's."""
    for a, b in zip(replayed, through_jit):
        assert (a is None) == (b is None)
        assert a is None or (not a.isnan().any() and torch.equal(a, b))


def assert_next_call_replays(monkeypatch, call, replays, *, seed, config, output_dtype, calls=None):
    """After ``call(seed)`` (-> inputs, outputs) recorded its first call: ``call(seed)`` now is replayed whole (one
    replay in ``replays``, from ``spy_on_replays``; no wrapper runs, where ``calls`` counts a spied wrapper's runs)
    into NaN-poisoned outputs, bitwise equal to the same call launched through Triton's JIT (whose wrappers run)."""
    recorded = None if calls is None else len(calls)
    inputs, replayed = call(seed)
    assert len(replays) == 1 and (calls is None or len(calls) == recorded)  # replayed: no wrapper ran
    monkeypatch.setenv("MAMBA3_MIMO_JIT_LAUNCH", "1")
    through_jit = api.bwd_fwd(**inputs, output_dtype=output_dtype, config=config)
    assert len(replays) == 1 and (calls is None or len(calls) > recorded)
    assert_replay_equals_jit(replayed, through_jit)


def seed_for(*parts):
    """A deterministic seed that differs between tests (and between calls of one test)."""
    return zlib.crc32(repr(parts).encode())


def run_and_check(impl, *, device, seed, dtype=torch.float32, output_dtype=torch.float32, config=None,
                  ref_device="cpu", transform=None, **input_kwargs):
    """Run ``impl`` on fresh inputs and assert the accuracy contract of SPEC section 7.

    The golden is the float64 reference, the bench the reference in the activation dtype, both
    computed on ``ref_device`` ("cpu", or "kernel" for the kernel's device: for big problems).
    ``transform`` (inputs dict -> inputs dict) alters the inputs that all three see.  fp32 draws that
    fail only the dual benchmark are judged again on fresh draws (``accuracy.judge_with_redraws``).
    Returns the list of ``OutputCheck`` of the last draw judged.
    """
    def judge(draw_seed):
        inputs = make_inputs(device=device, seed=draw_seed, dtype=dtype, **input_kwargs)
        if transform is not None:
            inputs = transform(inputs)
        candidate = api.bwd_fwd(**inputs, output_dtype=output_dtype, impl=impl, config=config)
        ref_inputs = to_device(inputs, device if ref_device == "kernel" else ref_device)
        golden = bwd_fwd_reference(**ref_inputs, compute_dtype=torch.float64)
        bench = bwd_fwd_reference(**ref_inputs, compute_dtype=dtype)
        return check_outputs(candidate, golden, bench, dtype, output_dtype)

    return judge_with_redraws(judge, seed, dtype)


@pytest.fixture
def check_kernel(request, device, poison_outputs):
    """``run_and_check`` on the test's device with poisoned outputs and a fresh seed per call."""
    calls = itertools.count()

    def check(impl, **kwargs):
        kwargs.setdefault("seed", seed_for(request.node.nodeid, next(calls)))
        return run_and_check(impl, device=device, **kwargs)

    return check
