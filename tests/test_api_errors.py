"""Bad input is refused before any launch with a message naming the argument (SPEC section 5);
good input is never modified and may be non-contiguous."""

import functools

import pytest
import torch

import mamba3_mimo.api as api
from conftest import seed_for, to_device
from mamba3_mimo import bwd_fwd, mamba3_mimo_bwd_fwd_kernel
from mamba3_mimo.inputs import make_inputs

OUTPUT_NAMES = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
TENSOR_NAMES = ("dout", "q", "k", "v", "q_bias", "k_bias", "mimo_v", "mimo_o", "angles", "da_cs", "da_cs_rev",
                "dt", "trap", "segsum", "mimo_z", "d", "z")
# B=1, S=20, H=4, G=2, N=16, P=8, R=2, C=8 (nch=3), RD=4.
SIZES = dict(B=1, S=20, H=4, G=2, N=16, P=8, R=2, chunk_size=8)
ENTRIES = {
    "public": mamba3_mimo_bwd_fwd_kernel,
    "stage0": functools.partial(bwd_fwd, impl="stage0"),
}


@pytest.fixture(scope="module")
def base():
    return make_inputs(dtype=torch.bfloat16, seed=seed_for("api_errors"), **SIZES)


@pytest.fixture(params=list(ENTRIES))
def entry(request):
    return ENTRIES[request.param]


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails the test: every error must come from validation."""
    def launched(**kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(api, "production_bwd_fwd", launched)
    monkeypatch.setattr(api, "stage0_bwd_fwd", launched)


def call(entry, base, **overrides):
    return entry(**dict(base, **overrides))


def grown(x, dim):
    """x with one more entry along ``dim``."""
    return torch.cat([x, x.narrow(dim, 0, 1)], dim=dim)


def test_no_launch_fixture_catches_launches(base, no_launch, entry):
    # On the device where the kernels run (CPU tensors are refused on a CUDA machine, before any launch).
    with pytest.raises(AssertionError, match="launched"):
        call(entry, to_device(base, "cuda" if torch.cuda.is_available() else "cpu"))


# --- shapes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("change", ["extra_dim", "missing_dim"])
@pytest.mark.parametrize("name", TENSOR_NAMES)
def test_wrong_rank(base, no_launch, entry, name, change):
    x = base[name]
    bad = x[..., None] if change == "extra_dim" else x[0]
    with pytest.raises(ValueError, match=rf"^{name}: expected a {x.dim()}-d tensor"):
        call(entry, base, **{name: bad})


@pytest.mark.parametrize("name,dim", [(n, dim) for n in TENSOR_NAMES if n not in ("q", "dout")
                                      for dim in ((0,) if n == "d" else (0, -1))])
def test_wrong_size(base, no_launch, entry, name, dim):
    bad = grown(base[name], dim)
    with pytest.raises(ValueError, match=rf"^{name}: expected shape") as info:
        call(entry, base, **{name: bad})
    message = str(info.value)
    assert str(list(base[name].shape)) in message and str(list(bad.shape)) in message


# q and dout define the sizes, so a wrong size there shows as a mismatch of the next tensor.
@pytest.mark.parametrize("name,dim,blamed", [("q", 1, "dout"), ("q", 4, "k"), ("q", 2, "k"),
                                             ("dout", 3, "v"), ("dout", 2, "v"),
                                             ("dout", 0, "dout")])
def test_wrong_size_of_size_defining_inputs(base, no_launch, entry, name, dim, blamed):
    x = base[name]
    bad = grown(grown(x, dim), dim)  # +2 keeps N even
    with pytest.raises(ValueError, match=rf"\b{blamed}\b.*expected shape.*got"):
        call(entry, base, **{name: bad})


@pytest.mark.parametrize("change", [-1, 1])
def test_segsum_wrong_chunk_count(base, no_launch, entry, change):
    segsum = base["segsum"]
    bad = segsum[:, :, :-1] if change < 0 else grown(segsum, 2)
    with pytest.raises(ValueError, match=r"^segsum: expected shape \[1, 4, 3, 8, 8\]"):
        call(entry, base, segsum=bad)


def test_empty_sequence(base, no_launch, entry):
    with pytest.raises(ValueError, match=r"\bS\b.*>= 1"):
        call(entry, base, q=base["q"][:, :0])


def test_heads_not_a_multiple_of_groups(base, no_launch, entry):
    q, k = (torch.cat([x, x[:, :, :, :1]], dim=3) for x in (base["q"], base["k"]))  # G = 3, H = 4
    with pytest.raises(ValueError, match=r"H % G"):
        call(entry, base, q=q, k=k)


def test_odd_n(base, no_launch, entry):
    with pytest.raises(ValueError, match=r"(?=.*\bN\b)(?=.*even)"):
        call(entry, base, q=base["q"][..., :15], k=base["k"][..., :15])


@pytest.mark.parametrize("divisor", [1, 0, -2, 2.0])
def test_bad_rotary_dim_divisor(base, no_launch, entry, divisor):
    """divisor 1 gives RD = N > N/2; the others are not an int >= 1."""
    with pytest.raises(ValueError, match="rotary_dim_divisor"):
        call(entry, base, rotary_dim_divisor=divisor)


def test_chunk_too_large_for_rank(base, no_launch, entry):
    with pytest.raises(ValueError, match="chunk_size"):
        call(entry, base, chunk_size=256)


# --- optional and required arguments --------------------------------------------------------------

def test_mimo_z_without_z(base, no_launch, entry):
    with pytest.raises(ValueError, match=r"mimo_z was given without z"):
        call(entry, base, z=None)


def test_z_without_mimo_z(base, no_launch, entry):
    with pytest.raises(ValueError, match=r"\bz was given without mimo_z"):
        call(entry, base, mimo_z=None)


@pytest.mark.parametrize("name", ["mimo_o", "q", "segsum"])
def test_missing_required(base, no_launch, entry, name):
    with pytest.raises(ValueError, match=rf"^{name} is required"):
        call(entry, base, **{name: None})


@pytest.mark.parametrize("name,value", [("q", lambda x: x.tolist()), ("mimo_o", lambda x: x.numpy()),
                                        ("d", lambda x: 1.0), ("z", lambda x: x.float().numpy()),
                                        ("dt", lambda x: x.numpy())])
def test_non_tensor_argument(base, no_launch, entry, name, value):
    with pytest.raises(TypeError, match=rf"^{name}: expected a torch.Tensor"):
        call(entry, base, **{name: value(base[name])})


# --- dtypes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("name", ["dout", "q", "k", "v", "z", "trap", "q_bias", "mimo_o", "mimo_z", "d",
                                  "angles", "da_cs", "dt", "segsum"])
def test_integer_tensor(base, no_launch, entry, name, int_dtype):
    with pytest.raises(TypeError, match=rf"^{name}: expected a floating-point tensor"):
        call(entry, base, **{name: base[name].to(int_dtype)})


@pytest.mark.parametrize("name", ["dout", "q", "v", "z", "trap"])
def test_float64_activation(base, no_launch, entry, name):
    with pytest.raises(TypeError, match=rf"^{name}: expected dtype in"):
        call(entry, base, **{name: base[name].double()})


@pytest.mark.parametrize("output_dtype", [torch.float64, torch.int32, "float32", None])
def test_bad_output_dtype(base, no_launch, entry, output_dtype):
    with pytest.raises(TypeError, match="output_dtype"):
        call(entry, base, output_dtype=output_dtype)


@pytest.mark.parametrize("chunk_size", [0, -1, 16.0, "16", True, None])
def test_bad_chunk_size(base, no_launch, entry, chunk_size):
    with pytest.raises(ValueError, match="chunk_size"):
        call(entry, base, chunk_size=chunk_size)


def test_unknown_impl(base, no_launch):
    with pytest.raises(ValueError, match="impl"):
        bwd_fwd(**base, impl="reference")


# --- devices --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["v", "d", "segsum", "mimo_o", "z"])
def test_mismatched_devices(base, no_launch, entry, name):
    with pytest.raises(ValueError, match=rf"^{name} is on meta"):
        call(entry, base, **{name: base[name].to("meta")})


def test_cpu_without_interpreter(base, no_launch, entry, monkeypatch):
    monkeypatch.setattr(api, "interpreter_enabled", lambda: False)
    with pytest.raises(NotImplementedError, match=r"(?=.*cpu)(?=.*TRITON_INTERPRET)"):
        call(entry, base)


def test_unsupported_device(base, no_launch, entry):
    meta = {name: x.to("meta") if isinstance(x, torch.Tensor) else x for name, x in base.items()}
    with pytest.raises(NotImplementedError, match="meta"):
        entry(**meta)


def test_validation_cache_does_not_hide_errors(base, no_launch, entry):
    """Validated problems are cached by each tensor's shape, dtype and device (and the other arguments);
    once the good problem is cached, variants differing in any of those are checked again."""
    good = to_device(base, "cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(AssertionError, match="launched"):
        call(entry, good)  # validated (and cached); the no-launch stub fires after
    args = dict(good, output_dtype=torch.float32, rotary_dim_divisor=4)
    first = api.validate(**args)
    assert api.validate(**args) is first and first == api._check_problem(**args)
    with pytest.raises(TypeError, match="^q: expected dtype"):
        call(entry, good, q=good["q"].to(torch.float64))
    with pytest.raises(ValueError, match="^segsum"):
        call(entry, good, segsum=grown(good["segsum"], 3))
    with pytest.raises(ValueError, match="^chunk_size"):
        call(entry, good, chunk_size=0)
    with pytest.raises(TypeError, match="^d: expected a torch.Tensor"):
        call(entry, good, d=[1.0] * SIZES["H"])
    with pytest.raises(ValueError, match="^v is on meta"):
        call(entry, good, v=good["v"].to("meta"))


# --- real calls: inputs untouched, any strides ----------------------------------------------------

@pytest.fixture(scope="module")
def device_inputs():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return make_inputs(dtype=torch.bfloat16, device=device, seed=seed_for("api_real_calls"), **SIZES)


def test_poison_hook_fills_outputs(device_inputs, poison_outputs, monkeypatch):
    """With the kernels replaced by no-ops, every output comes back NaN: unwritten elements show."""
    monkeypatch.setattr(api, "production_bwd_fwd", lambda **kwargs: None)
    outputs = bwd_fwd(**device_inputs)
    assert all(bool(torch.isnan(x).all()) for x in outputs)


@pytest.mark.parametrize("impl", api.IMPLEMENTATIONS)
def test_inputs_not_modified(device_inputs, poison_outputs, impl):
    before = {name: x.clone() for name, x in device_inputs.items() if isinstance(x, torch.Tensor)}
    outputs = bwd_fwd(**device_inputs, impl=impl)
    assert all(bool(torch.isfinite(x).all()) for x in outputs)
    for name, x in before.items():
        assert torch.equal(device_inputs[name], x), f"{name} was modified in place"


def strided(x):
    """Same values, last dim with stride 2, NaN in between (read them and the result is NaN)."""
    wide = torch.full((*x.shape[:-1], 2 * x.shape[-1]), float("nan"), dtype=x.dtype, device=x.device)
    wide[..., ::2] = x
    return wide[..., ::2]


def sliced(x):
    """Same values, a slice of a wider NaN-filled tensor along the last dim."""
    wide = torch.full((*x.shape[:-1], x.shape[-1] + 5), float("nan"), dtype=x.dtype, device=x.device)
    wide[..., 2:-3] = x
    return wide[..., 2:-3]


def transposed(x, a, b):
    """Same values, stored with dims a and b swapped."""
    return x.transpose(a, b).contiguous().transpose(a, b)


@pytest.mark.parametrize("impl", api.IMPLEMENTATIONS)
def test_non_contiguous_inputs(device_inputs, poison_outputs, impl):
    x = device_inputs
    views = dict(
        q=transposed(x["q"], 1, 3), k=strided(x["k"]), v=sliced(x["v"]), dout=transposed(x["dout"], 1, 2),
        z=strided(x["z"]), q_bias=transposed(x["q_bias"], 0, 1), k_bias=sliced(x["k_bias"]),
        mimo_v=strided(x["mimo_v"]), mimo_o=transposed(x["mimo_o"], 1, 2), mimo_z=sliced(x["mimo_z"]),
        d=strided(x["d"]), angles=transposed(x["angles"], 1, 2), da_cs=strided(x["da_cs"]),
        da_cs_rev=sliced(x["da_cs_rev"]), dt=transposed(x["dt"], 0, 2), trap=strided(x["trap"]),
        segsum=transposed(x["segsum"], 3, 4),
    )
    for name, view in views.items():
        assert not view.is_contiguous() and torch.equal(view, x[name]), name
    want = bwd_fwd(**x, impl=impl)
    got = bwd_fwd(**dict(x, **views), impl=impl)
    for name, a, b in zip(OUTPUT_NAMES, got, want):
        assert torch.equal(a, b), f"{name} differs with non-contiguous inputs"


def test_outputs_are_fresh_and_typed(device_inputs, poison_outputs):
    outputs = mamba3_mimo_bwd_fwd_kernel(**device_inputs, output_dtype=torch.float16)
    shapes = [(1, 4, 3, 16, 8), (1, 4, 20, 2, 2), (1, 4, 2, 8), (1, 4, 2, 8), (1, 20, 4, 8)]
    for out, shape in zip(outputs, shapes):
        assert tuple(out.shape) == shape and out.dtype == torch.float16 and out.is_contiguous()
    no_gate = mamba3_mimo_bwd_fwd_kernel(**dict(device_inputs, z=None, mimo_z=None))
    assert no_gate[3] is None and no_gate[4] is None and no_gate[0].dtype == torch.float32


# --- limits of the kernels ------------------------------------------------------------------------

def test_batch_element_beyond_int32_is_refused(no_launch, entry):
    """One batch element of more than 2^31 elements would overflow the kernels' int32 offsets."""
    B, S, H, G, N, P, R, C = 1, 1 << 21, 8, 1, 16, 1024, 1, 64  # v: S*H*P = 2^34 elements
    nch = S // C

    def big(*shape):  # a stride-0 view: no memory behind the shape
        return torch.zeros(1).expand(*shape)

    inputs = dict(dout=big(B, S, H, P), q=big(B, S, R, G, N), k=big(B, S, R, G, N), v=big(B, S, H, P),
                  q_bias=big(H, R, N), k_bias=big(H, R, N), mimo_v=big(H, R, P), mimo_o=big(H, R, P),
                  angles=big(B, S, H, N // 4), da_cs=big(B, H, S), da_cs_rev=big(B, H, S), dt=big(B, H, S),
                  trap=big(B, H, S), segsum=big(B, H, nch, C, C), chunk_size=C)
    with pytest.raises(ValueError, match=r"^v: one batch element spans \d+ elements"):
        entry(**inputs)


@pytest.mark.parametrize("fields,match", [
    (dict(block_p=24, n_segments=1), "block_p"), (dict(block_p=8, n_segments=1), "block_p"),
    (dict(block_p=32, n_segments=0), "n_segments"), (dict(block_p=32, n_segments=2, num_warps=3), "num_warps"),
    (dict(block_p=32, n_segments=2, block_half=48), "block_half"),
    (dict(block_p=32, n_segments=2, out_block_p=8), "out_block_p"),
    (dict(block_p=32, n_segments=2, chunks_per_program=0), "chunks_per_program"),
    (dict(block_p=32, n_segments=2, out_num_warps=6), "out_num_warps"),
    (dict(block_p=32, n_segments=2, out_max_registers=300), "out_max_registers"),
    (dict(block_p=32, n_segments=2, scan_max_registers=16), "scan_max_registers"),
    (dict(block_p=32, n_segments=2, gate_tile_elements=3000), "gate_tile_elements"),
    (dict(block_p=32, n_segments=2, gate_num_warps=5), "gate_num_warps"),
    (dict(block_p=32, n_segments=2, gluon_segments=-1), "gluon_segments"),
    (dict(block_p=32, n_segments=2, scan_outputs_block_p=48), "scan_outputs_block_p"),
])
def test_bad_scan_config_is_refused(fields, match):
    from mamba3_mimo.ops.production import ScanConfig

    with pytest.raises(ValueError, match=rf"ScanConfig\.{match}"):
        ScanConfig(**fields)
