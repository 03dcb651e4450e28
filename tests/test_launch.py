"""ops/launch.py: launches through the compiled kernel's launcher once a specialization is known.

The key must separate every launch Triton would compile differently (dtype, 16-byte alignment, int
values, constexprs), and a cached launch must compute what the JIT's does.  The CPU runs check the key and
the argument handling; the GPU runs launch for real.
"""

import os

import pytest
import torch
from conftest import assert_next_call_replays, requires_cuda, seed_for, spy_on_replays

import mamba3_mimo.ops.launch as launch_module
from mamba3_mimo.ops.production import ScanConfig
from mamba3_mimo.ops.token_tables import _token_tables_kernel, token_tables


def test_key_separates_dtype_and_alignment():
    x = torch.zeros(64, dtype=torch.float32)
    assert launch_module._spec(x) == (torch.float32, True)
    assert launch_module._spec(x[1:]) == (torch.float32, False)  # 4 bytes in: not 16-byte aligned
    assert launch_module._spec(x[4:]) == (torch.float32, True)
    assert launch_module._spec(x.to(torch.bfloat16)) == (torch.bfloat16, True)
    assert launch_module._spec(7) == 7 and launch_module._spec(None) is None
    assert launch_module._spec(0.5) is float
    assert launch_module._spec(True) != launch_module._spec(1)


def test_trailing_args_take_kwargs_then_defaults():
    n_positional = 10  # the pointers and S, H, RD of _token_tables_kernel
    trailing = launch_module._trailing_args(_token_tables_kernel, n_positional,
                                            dict(BLOCK_T=256, BLOCK_RD=16, ANGLE_ROWS=32, FAST_TRIG=False,
                                                 num_warps=4))
    assert trailing == (256, 16, 32, False, False)  # GDC from its default
    with pytest.raises(TypeError, match="ANGLE_ROWS was not given"):
        launch_module._trailing_args(_token_tables_kernel, n_positional, dict(BLOCK_T=256, BLOCK_RD=16))
    with pytest.raises(TypeError, match="pass tensor BLOCK_T positionally"):
        launch_module._trailing_args(_token_tables_kernel, n_positional,
                                     dict(BLOCK_T=torch.zeros(1), BLOCK_RD=16, ANGLE_ROWS=32, FAST_TRIG=False))


def _spy_on_launch_options(monkeypatch):
    """[(GDC, launch_pdl)] of every kernel run from here on (through the JIT or the interpreter's stand-in)."""
    options = []
    kernel_type = type(_token_tables_kernel)
    run = kernel_type.run
    monkeypatch.setattr(kernel_type, "run", lambda self, *args, **kwargs: (
        options.append((kwargs.get("GDC", False), kwargs.get("launch_pdl", False))), run(self, *args, **kwargs))[1])
    return options


def test_dependent_launches_mark_the_kernels_that_wait(monkeypatch):
    """Inside ``dependent_launches`` a kernel that declares GDC gets its wait compiled in and the PDL launch option;
    a kernel without the parameter launches as usual, and so does everything outside the block or with it off."""
    from mamba3_mimo.ops.stage0 import _rotary_kernel

    seen = []
    for kernel in (_token_tables_kernel, _rotary_kernel):
        monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, _name=kernel.fn.__name__, **kwargs:
                            seen.append((_name, kwargs)))
    x = torch.zeros(4)
    with launch_module.dependent_launches():
        launch_module.launch(_token_tables_kernel, (1,), x, FAST_TRIG=False)
        launch_module.launch(_rotary_kernel, (1,), x, BLOCK_ROWS=16)
    with launch_module.dependent_launches(False):
        launch_module.launch(_token_tables_kernel, (1,), x, FAST_TRIG=False)
    launch_module.launch(_token_tables_kernel, (1,), x, FAST_TRIG=False)
    assert seen == [("_token_tables_kernel", dict(FAST_TRIG=False, GDC=True, launch_pdl=True)),
                    ("_rotary_kernel", dict(BLOCK_ROWS=16)),
                    ("_token_tables_kernel", dict(FAST_TRIG=False)),
                    ("_token_tables_kernel", dict(FAST_TRIG=False))]


def test_pdl_is_inert_off_the_gpu(monkeypatch):
    """``ScanConfig.pdl`` needs a Hopper GPU: under the interpreter no launch
    asks for it (the wait is inline PTX) and the outputs are bit for bit those without it."""
    from conftest import assert_knob_inert

    from mamba3_mimo.inputs import make_inputs
    from mamba3_mimo.ops.production import choose_config

    if torch.cuda.is_available():
        pytest.skip("the knob is live on a GPU: test_official_pdl checks it there")
    options = _spy_on_launch_options(monkeypatch)
    inputs = make_inputs(B=1, S=48, H=2, G=1, N=32, P=32, R=2, chunk_size=16, dtype=torch.float32, seed=11)
    base = choose_config(B=1, H=2, S=48, N=32, P=32, R=2, chunk_size=16, num_sms=4)
    assert_knob_inert(inputs, base, "pdl", output_dtype=torch.float32)
    assert len(options) >= 8 and set(options) == {(False, False)}  # both calls' launches, none of them dependent


@pytest.mark.parametrize("knobs", [dict(local_states=True, split_gate=True, n_segments=3),
                                   dict(local_states=True, split_gate=True, gate_in_scan=True, n_segments=3,
                                        fold_one_scan=True),
                                   dict(local_states=False, split_gate=True, n_segments=2),
                                   dict(local_states=False, split_gate=False, n_segments=2)],
                         ids=["local-split", "gate-in-scan-fold1", "two-pass-split", "two-pass-fused"])
def test_dependent_launch_code_paths_give_the_same_outputs(monkeypatch, knobs):
    """The kernels' code paths under ``ScanConfig.pdl`` (chunk_scan's tables asked for before its states, the segment
    fold's decay table before the fold, gate_grads' first dout / z / v before raw_y) compute what the plain paths do,
    bit for bit.  The interpreter runs those paths without the wait instruction (``triton_utils.INTERPRETED``); on the
    GPU ``test_official_pdl`` checks the calls with the waits (accuracy, repeatability)."""
    from conftest import assert_knob_inert

    from mamba3_mimo.inputs import make_inputs
    from mamba3_mimo.ops import production, triton_utils

    if torch.cuda.is_available() or not triton_utils.INTERPRETED:
        pytest.skip("the interpreter's run of the dependent-launch paths")
    launched = _spy_on_launch_options(monkeypatch)
    monkeypatch.setattr(production, "dependent_launch_supported", lambda tensor: True)
    inputs = make_inputs(B=1, S=96, H=2, G=1, N=32, P=32, R=2, chunk_size=16, dtype=torch.float32, seed=13)
    base = ScanConfig(block_p=16, out_block_p=32, **knobs)
    assert_knob_inert(inputs, base, "pdl", output_dtype=torch.float32)
    # the second call's launches all took their dependent-launch paths (the first call's none)
    options = [gdc for gdc, _ in launched]
    assert True in options and False in options and options[len(options) // 2:] == [True] * (len(options) // 2)


def _tables_inputs(gen, B, H, S, RD, device, offset=0):
    """dt, trap, angles on ``device``; with ``offset`` every tensor is a view ``offset`` elements into
    a larger buffer (misaligned for offsets that are not a multiple of 4 fp32)."""
    def view(shape, scale):
        numel = torch.Size(shape).numel()
        buffer = torch.randn(numel + offset, generator=gen) * scale
        return buffer.to(device)[offset:].view(shape)
    return view((B, H, S), 0.1), view((B, H, S), 1.0), view((B, S, H, RD), 30.0)


@requires_cuda
def test_cached_launch_matches_jit_and_respecializes():
    """The second call goes through the cached launcher and is bitwise the JIT's; misaligned views,
    launched after aligned ones, get their own specialization and stay exact."""
    gen = torch.Generator().manual_seed(seed_for("cached_launch"))
    aligned = _tables_inputs(gen, 2, 3, 300, 16, "cuda")
    dt, trap, angles = aligned
    first = token_tables(dt=dt, trap=trap, angles=angles)
    entries = len(launch_module._compiled)
    cached = token_tables(dt=dt, trap=trap, angles=angles)
    assert len(launch_module._compiled) == entries  # a hit
    os.environ["MAMBA3_MIMO_JIT_LAUNCH"] = "1"
    try:
        through_jit = token_tables(dt=dt, trap=trap, angles=angles)
    finally:
        del os.environ["MAMBA3_MIMO_JIT_LAUNCH"]
    for a, b, c in zip(first, cached, through_jit):
        assert torch.equal(a, b) and torch.equal(a, c)

    dt, trap, angles = _tables_inputs(gen, 2, 3, 300, 16, "cuda", offset=1)
    assert dt.data_ptr() % 16 != 0
    gamma, trap_scale, cos_angles, sin_angles = token_tables(dt=dt, trap=trap, angles=angles)
    assert len(launch_module._compiled) == entries + 1
    want_gamma = dt.double() * torch.sigmoid(trap.double())
    torch.testing.assert_close(gamma.double(), want_gamma, atol=1e-6, rtol=1e-5)  # dt < 0 is fine here
    torch.testing.assert_close(cos_angles.double(), angles.double().cos(), atol=2e-6, rtol=0)
    torch.testing.assert_close(sin_angles.double(), angles.double().sin(), atol=2e-6, rtol=0)


def test_plan_key_separates_alignment_config_and_implementation():
    from mamba3_mimo.api import launch_plan_key
    from mamba3_mimo.ops.production import ScanConfig

    x = torch.zeros(64)
    signature = (((64,), torch.float32),)
    aligned = launch_plan_key(signature, "production", None, (x, None, x[4:]))
    assert aligned == launch_plan_key(signature, "production", None, (x[8:], None, x))
    assert aligned != launch_plan_key(signature, "production", None, (x, None, x[1:]))
    assert aligned != launch_plan_key(signature, "production", None, (x, x, x))  # an optional tensor given
    assert aligned != launch_plan_key(signature, "stage0", None, (x, None, x))
    assert aligned != launch_plan_key(signature, "production", ScanConfig(block_p=16, n_segments=1), (x, None, x))
    assert launch_plan_key(None, "production", None, (x,)) is None  # unhashable signature: no plan


@requires_cuda
def test_launch_plan_replays_the_first_calls_kernels(monkeypatch):
    """A second call with the same signature replays the plan's kernels (no new slots), bitwise equal to the
    first call and to the JIT's launches; a misaligned input makes a new plan whose results match; the plan
    check catches a slot that holds a kernel its full key does not select."""
    from mamba3_mimo.api import bwd_fwd
    from mamba3_mimo.inputs import make_inputs

    monkeypatch.setenv("MAMBA3_MIMO_CHECK_PLAN", "1")
    monkeypatch.setattr(launch_module, "_plan_slots", {})  # every slot below is this test's
    # Chunks of 32 (token, rank) rows at N = 32 take the single-chunk gated chunk_scan (no gate_grads, four kernels,
    # production.SMALL_CHUNK_SCAN); 64-row chunks keep the split stage's five or more.
    inputs = make_inputs(B=1, S=96, H=2, N=32, P=32, R=2, chunk_size=32, device="cuda",
                         seed=seed_for("launch_plan"))
    first = bwd_fwd(**inputs, output_dtype=torch.float32)
    slots = dict(launch_module._plan_slots)
    second = bwd_fwd(**inputs, output_dtype=torch.float32)
    assert launch_module._plan_slots == slots and len(slots) >= 5
    monkeypatch.setenv("MAMBA3_MIMO_JIT_LAUNCH", "1")
    through_jit = bwd_fwd(**inputs, output_dtype=torch.float32)
    monkeypatch.delenv("MAMBA3_MIMO_JIT_LAUNCH")
    for a, b, c in zip(first, second, through_jit):
        assert a is None or (torch.equal(a, b) and torch.equal(a, c))

    buffer = torch.empty(inputs["v"].numel() + 1, device="cuda", dtype=inputs["v"].dtype)
    shifted = buffer[1:].view(inputs["v"].shape)
    shifted.copy_(inputs["v"])
    assert shifted.data_ptr() % 16 != 0
    misaligned = bwd_fwd(**dict(inputs, v=shifted), output_dtype=torch.float32)
    assert len(launch_module._plan_slots) > len(slots)
    for a, b in zip(first, misaligned):
        assert a is None or torch.allclose(a, b, rtol=1e-6, atol=1e-6)

    # Swap the first two slots of the aligned plan (two different kernels): a replay must notice.
    (key,) = {slot[0] for slot in slots}
    (k0, *entry0), (_, *entry1) = slots[(key, 0)], slots[(key, 1)]
    launch_module._plan_slots[(key, 0)] = (k0, *entry1)
    try:
        with pytest.raises(AssertionError, match="launch plan"):
            bwd_fwd(**inputs, output_dtype=torch.float32)
    finally:
        launch_module._plan_slots[(key, 0)] = (k0, *entry0)


class _FakeCompiled:
    """Stands in for a compiled kernel in the recording tests: only its identity matters."""


def _record_one(roots, kernel, args, trailing=(16, True)):
    record = launch_module._CallRecord(roots)
    record.add(kernel, trailing, (3, 2), 0, args)
    return record


def test_call_record_describes_roots_scratch_and_literals():
    q, out = torch.zeros(64), torch.zeros(32)
    scratch = torch.zeros(200)  # one allocation, two views: one region, two offsets
    kernel = _FakeCompiled()
    record = _record_one((q, None, out), kernel, (q, scratch[:100], 7, None, out, scratch[100:], 0.5))
    assert record.replayable and record.scratch_bytes == 1024  # 800 bytes, rounded up to 512-byte blocks
    (compiled, trailing, grid, literals, pointers), = record.launches
    assert compiled is kernel and trailing == (16, True) and grid == (3, 2, 1)
    assert literals == (None, None, 7, None, None, None, 0.5)
    assert pointers == ((0, 0, 0, None), (1, -1, 0, None), (4, 2, 0, None), (5, -1, 400, None))

    # Another call's tensors in the same places record the same launches; a kernel, literal or trailing
    # constexpr that differs does not.
    q2, out2, scratch2 = torch.zeros(64), torch.zeros(32), torch.zeros(200)
    same = _record_one((q2, None, out2), kernel, (q2, scratch2[:100], 7, None, out2, scratch2[100:], 0.5))
    assert record.same_launches(same)
    roots2, low, high = (q2, None, out2), scratch2[:100], scratch2[100:]
    for other in (_record_one(roots2, _FakeCompiled(), (q2, low, 7, None, out2, high, 0.5)),
                  _record_one(roots2, kernel, (q2, low, 8, None, out2, high, 0.5)),
                  _record_one(roots2, kernel, (out2, low, 7, None, q2, high, 0.5)),
                  _record_one(roots2, kernel, (q2, low, 7, None, out2, high, 0.5), trailing=(32,))):
        assert not record.same_launches(other)


def test_call_record_rebuilds_host_tensor_descriptors():
    """A host tensor descriptor (the Gluon scan's TMA arguments) is recorded by its base, as a tensor is, plus its
    shape, strides and padding; the replay passes a descriptor of the same fields around the new call's pointer,
    which is all Triton's launcher reads of it (``make_tensordesc_arg``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    k, out = torch.zeros(4, 8, 64), torch.zeros(32)
    scratch = torch.zeros(2, 64)
    k_view = TensorDescriptor(k, [4, 8, 64], [8 * 64, 64, 1], [2, 8, 64])  # not k's own shape: a view of it
    tables = TensorDescriptor(scratch, [2, 64], [64, 1], [2, 32])
    assert launch_module._is_descriptor(k_view) and not launch_module._is_descriptor(k)
    assert launch_module._spec(k_view)[0] == "tensordesc"
    assert launch_module._spec(k_view) != launch_module._spec(TensorDescriptor(k, [4, 8, 64], [512, 64, 1], [1, 8, 64]))
    kernel = _FakeCompiled()
    record = _record_one((k, out), kernel, (k_view, tables, out, 3))
    assert record.replayable and record.scratch_bytes == 512
    literals, pointers = record.launches[0][3:]
    assert literals == (None, None, None, 3)
    assert pointers == ((0, 0, 0, ((4, 8, 64), (512, 64, 1), "zero")), (1, -1, 0, ((2, 64), (64, 1), "zero")),
                        (2, 1, 0, None))
    rebuilt = launch_module._DescriptorAt(4096, *pointers[0][3])
    assert rebuilt.base.data_ptr() == 4096 and rebuilt.shape == [4, 8, 64] and rebuilt.strides == [512, 64, 1]
    assert rebuilt.padding == "zero"
    # A descriptor over a view of a root is a view of a root: not replayable.
    viewed = _record_one((k, out), kernel, (TensorDescriptor(k[1:], [3, 8, 64], [512, 64, 1], [1, 8, 64]),))
    assert not viewed.replayable


@pytest.mark.parametrize("case", ["root_view", "aliased_roots"])
def test_call_record_refuses_what_it_cannot_replay(case):
    q, out = torch.zeros(64), torch.zeros(32)
    if case == "aliased_roots":  # one tensor passed twice: its launches could not tell the two apart
        assert not launch_module._CallRecord((q, q, out)).replayable
        return
    # A view of a root is not the root: not described by identity.
    record = launch_module._CallRecord((q, out))
    record.add(_FakeCompiled(), (), (1,), 0, (q[8:],))
    assert not record.replayable


def test_call_record_gives_reused_scratch_a_region_of_its_own():
    """A storage overlapping a region seen before (a block the allocator handed out again, at another size, after
    its first tensor was freed within the call) gets its own region after the earlier ones; the same block at the
    same size keeps its region."""
    q, out = torch.zeros(64), torch.zeros(32)
    record = launch_module._CallRecord((q, out))
    block = torch.zeros(256)
    base = block.untyped_storage().data_ptr()
    record.scratch[(base + 4, 16)] = 0  # an earlier tensor's region inside this block
    record.scratch_bytes = record.SCRATCH_ALIGN
    record.add(_FakeCompiled(), (), (1,), 0, (block[2:],))
    record.add(_FakeCompiled(), (), (1,), 0, (block,))
    assert record.replayable
    assert record.scratch[(base, block.untyped_storage().nbytes())] == record.SCRATCH_ALIGN
    assert record.scratch_bytes == record.SCRATCH_ALIGN + 1024  # 256 fp32 after the earlier region
    # Both launches point into the new region: at its start plus the view's byte offset, and at its start.
    assert [launch[4] for launch in record.launches] == [((0, -1, record.SCRATCH_ALIGN + 8, None),),
                                                         ((0, -1, record.SCRATCH_ALIGN, None),)]


REPLAY_CASES = {
    # the dispatcher's config (two passes of one segment at this length), Z and D on
    "default-z": (dict(N=32, P=32, R=2, chunk_size=16, z=True, d=True), None),
    # local states over three segments, two P tiles, the split stage with gate_grads
    "local-split": (dict(N=64, P=64, R=4, chunk_size=16, z=True, d=True),
                    dict(block_p=32, n_segments=3, block_half=32, out_block_p=64, out_num_warps=4, local_states=True,
                         split_gate=True, out_max_registers=168)),
    # two passes over two segments with spans of two chunks of 8, gate in chunk_scan, no Z
    "two-pass-gate-in-scan": (dict(N=128, P=128, R=4, chunk_size=8, z=False, d=True),
                              dict(block_p=64, n_segments=2, block_half=32, out_block_p=128, out_num_warps=4,
                                   out_span_chunks=2, end_span_chunks=2, split_gate=True, gate_in_scan=True,
                                   out_max_registers=168)),
    # the fused output stage, R = 3
    "fused": (dict(N=32, P=40, R=3, chunk_size=16, z=True, d=False),
              dict(block_p=16, n_segments=2, out_block_p=32, split_gate=False)),
}


@requires_cuda
@pytest.mark.parametrize("name", list(REPLAY_CASES))
def test_call_replay_matches_the_jit(name, monkeypatch, poison_outputs):
    """A second call with the same signature is replayed whole (no host wrapper runs) on other inputs, into
    NaN-poisoned outputs, bitwise equal to the same call launched through Triton's JIT."""
    from mamba3_mimo.api import bwd_fwd
    from mamba3_mimo.inputs import make_inputs
    from mamba3_mimo.ops.production import ScanConfig

    replays = spy_on_replays(monkeypatch)  # the first call below records
    shape, fields = REPLAY_CASES[name]
    config = None if fields is None else ScanConfig(**fields)

    def call(seed):
        inputs = make_inputs(B=2, S=200, H=4, G=2, dtype=torch.bfloat16, device="cuda",
                             seed=seed_for(f"replay_{name}_{seed}"), **shape)
        return inputs, bwd_fwd(**inputs, output_dtype=torch.float32, config=config)

    call(0)
    assert_next_call_replays(monkeypatch, call, replays, seed=1, config=config, output_dtype=torch.float32)


@requires_cuda
def test_call_with_a_torch_copy_is_not_replayed(monkeypatch):
    """fp32 inputs with bf16 outputs copy an fp32 state hand-off into ``states`` between the launches: such a
    call must run its wrappers every time."""
    from mamba3_mimo.api import bwd_fwd
    from mamba3_mimo.inputs import make_inputs

    replays = spy_on_replays(monkeypatch, fresh=False)
    inputs = make_inputs(B=1, S=64, H=2, N=32, P=32, R=2, chunk_size=16, dtype=torch.float32, device="cuda",
                         seed=seed_for("replay_handoff"))
    first = bwd_fwd(**inputs, output_dtype=torch.bfloat16)
    second = bwd_fwd(**inputs, output_dtype=torch.bfloat16)
    assert not replays
    for a, b in zip(first, second):
        assert a is None or torch.equal(a, b)


@requires_cuda
def test_a_stubbed_implementation_is_not_replayed_over(monkeypatch, poison_outputs):
    """With a real call of a signature recorded, a stub put in place of production_bwd_fwd (as
    test_poison_hook_fills_outputs does) is called, not replayed over: the plan key holds the function."""
    import mamba3_mimo.api as api
    from mamba3_mimo.inputs import make_inputs

    monkeypatch.delenv("MAMBA3_MIMO_CHECK_PLAN", raising=False)
    inputs = make_inputs(B=1, S=48, H=2, N=16, P=16, R=2, chunk_size=8, device="cuda", seed=seed_for("stub_replay"))
    api.bwd_fwd(**inputs)
    api.bwd_fwd(**inputs)  # replayed
    calls = []
    monkeypatch.setattr(api, "production_bwd_fwd", lambda **kwargs: calls.append(1))
    outputs = api.bwd_fwd(**inputs)
    assert calls == [1] and all(bool(torch.isnan(x).all()) for x in outputs)
