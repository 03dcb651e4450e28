"""``torch.ops.mamba3_mimo.bwd_fwd``: opcheck, fake-tensor shapes, torch.compile(fullgraph=True).

On the CPU the op runs the kernels in the Triton interpreter, so the shapes are the smallest the
kernels take; with CUDA the same tests run on the GPU (and compile with inductor).
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mamba3_mimo  # noqa: F401  (registers the op)
import mamba3_mimo.api as api
from conftest import HAS_CUDA, seed_for
from mamba3_mimo.custom_op import bwd_fwd_op
from mamba3_mimo.inputs import make_inputs

OP = torch.ops.mamba3_mimo.bwd_fwd
TENSOR_ARGS = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs", "da_cs_rev",
               "dt", "trap", "segsum")
OUTPUT_NAMES = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
# Smallest case: one chunk tile, one head; S = 20 leaves a partial second chunk.
TINY = dict(B=1, S=20, H=1, G=1, N=16, P=16, R=1, chunk_size=16)
COMPILE_BACKEND = "inductor" if HAS_CUDA else "aot_eager"


def split_args(inputs):
    """make_inputs dict -> (positional tensors, keyword arguments) of the op."""
    args = tuple(inputs[name] for name in TENSOR_ARGS)
    kwargs = dict(mimo_z=inputs["mimo_z"], d=inputs["d"], z=inputs["z"], chunk_size=inputs["chunk_size"],
                  rotary_dim_divisor=inputs["rotary_dim_divisor"])
    return args, kwargs


def expected_shapes(B, S, H, N, P, R, chunk_size, z=True, **_):
    nch = -(-S // chunk_size)
    return dict(states=(B, H, nch, N, P), qk_dot=(B, H, S, R, R), dmimo_o=(B, H, R, P),
                dmimo_z=(B, H, R, P) if z else None, dz=(B, S, H, P) if z else None)


def test_schema_registered():
    schema = str(OP.default._schema)
    assert schema.startswith("mamba3_mimo::bwd_fwd(Tensor dout, Tensor q,")
    assert "Tensor? mimo_z=None, Tensor? d=None, Tensor? z=None" in schema
    assert schema.endswith("-> (Tensor, Tensor, Tensor, Tensor?, Tensor?)")
    assert bwd_fwd_op is OP


@pytest.mark.parametrize("gate", [True, False], ids=["z", "no_z"])
def test_opcheck(device, gate):
    inputs = make_inputs(**TINY, dtype=torch.float32, z=gate, d=gate, device=device, seed=seed_for("opcheck", gate))
    args, kwargs = split_args(inputs)
    result = torch.library.opcheck(OP.default, args, kwargs)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_op_matches_api(device):
    """The op is api.bwd_fwd: same outputs bit for bit, None without the gate, output_dtype honoured."""
    for gate, out_dtype in ((True, torch.bfloat16), (False, torch.float32)):
        inputs = make_inputs(**TINY, dtype=torch.float32, z=gate, d=True, device=device, seed=seed_for("api", gate))
        args, kwargs = split_args(inputs)
        got = OP(*args, **kwargs, output_dtype=out_dtype, impl="stage0")
        want = api.bwd_fwd(**inputs, output_dtype=out_dtype, impl="stage0")
        for name, x, y in zip(OUTPUT_NAMES, got, want):
            if y is None:
                assert x is None, name
            else:
                assert x.dtype == out_dtype and torch.equal(x, y), name


@pytest.mark.parametrize("gate", [True, False], ids=["z", "no_z"])
def test_fake_tensor_shapes(device, gate):
    sizes = dict(B=2, S=37, H=4, G=2, N=32, P=48, R=3, chunk_size=8)
    inputs = make_inputs(**sizes, dtype=torch.bfloat16, z=gate, d=gate, device=device, seed=0)
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for name, x in inputs.items()}
        args, kwargs = split_args(fake)
        outputs = OP(*args, **kwargs, output_dtype=torch.bfloat16)
    for (name, shape), x in zip(expected_shapes(**sizes, z=gate).items(), outputs):
        if shape is None:
            assert x is None, name
        else:
            assert tuple(x.shape) == shape and x.dtype == torch.bfloat16 and x.device.type == device.type, name


def test_fake_tensor_validates():
    """The fake implementation raises the API's errors (what torch.compile reports at trace time)."""
    inputs = make_inputs(**TINY, dtype=torch.float32, seed=0)
    with FakeTensorMode() as mode:
        fake = {name: mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for name, x in inputs.items()}
        args, kwargs = split_args(fake)
        with pytest.raises(ValueError, match="mimo_z and z together"):
            OP(*args, **dict(kwargs, z=None))
        bad = list(args)
        bad[TENSOR_ARGS.index("segsum")] = fake["segsum"][:, :, :1]
        with pytest.raises(ValueError, match="segsum"):
            OP(*bad, **kwargs)
        with pytest.raises(ValueError, match="impl"):
            OP(*args, **kwargs, impl="tilelang")


def test_op_validates_eagerly(device):
    inputs = make_inputs(**TINY, dtype=torch.float32, device=device, seed=0)
    args, kwargs = split_args(inputs)
    with pytest.raises(ValueError, match="mimo_z and z together"):
        OP(*args, **dict(kwargs, mimo_z=None))
    bad = list(args)
    bad[TENSOR_ARGS.index("q")] = inputs["q"].to(torch.int32)
    with pytest.raises(TypeError, match="q"):
        OP(*bad, **kwargs)


def test_compile_fullgraph(device):
    """torch.compile(fullgraph=True) of a caller of the op = the eager call, with and without the gate."""

    def step(dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
             mimo_z, d, z):
        states, qk_dot, dmimo_o, dmimo_z, dz = bwd_fwd_op(
            dout, q, k, v, q_bias, k_bias, mimo_v, mimo_o, angles, da_cs, da_cs_rev, dt, trap, segsum,
            mimo_z=mimo_z, d=d, z=z, chunk_size=16, rotary_dim_divisor=4)
        # What a caller does next: sum the per-batch parameter gradients.
        dphi = dmimo_o.sum(0)
        dzeta = dmimo_z.sum(0) if dmimo_z is not None else None
        return states, qk_dot, dphi, dzeta, dz

    compiled = torch.compile(step, fullgraph=True, backend=COMPILE_BACKEND)
    for gate in (True, False):
        inputs = make_inputs(**TINY, dtype=torch.float32, z=gate, d=True, device=device,
                             seed=seed_for("compile", gate))
        args = [inputs[name] for name in TENSOR_ARGS] + [inputs["mimo_z"], inputs["d"], inputs["z"]]
        got = compiled(*args)
        want = step(*args)
        for name, x, y in zip(OUTPUT_NAMES, got, want):
            if y is None:
                assert x is None, name
            else:
                torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
