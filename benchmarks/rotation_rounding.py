"""What rotating q and k in bf16 (``ScanConfig.scan_half_rotation``, ``out_half_rotation``) costs in accuracy.

The Triton interpreter cannot run bf16 arithmetic (it holds bf16 as raw 16-bit integers), and with bf16 activations
its products are fp32, so the CPU tests see the half rotation in fp16 only.  This emulates the GPU's two roundings
of the rotated rows in torch and runs the float64 reference on them (pre-rotated per head, angles 0, bias 0), so
every error it reports comes from the rotation alone:

- fp32 math (the default): bias added and rotated in fp32 with fp16 cos / sin tables, the result rounded to bf16
  once before the products;
- bf16 math: bias rounded to bf16 and added in bf16, bf16 tables, ``lo * cos - hi * sin`` as one rounded product
  and one fused multiply-add (the PTX has ``mul.bf16`` and ``fma.rn.bf16``), likewise the high half.

Prints, per shape, each output's normwise error against the exact rotation for both, and their ratio.

    python benchmarks/rotation_rounding.py [--seeds 2]
"""

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.reference import bwd_fwd_reference  # noqa: E402

BF16 = torch.bfloat16
OUTPUTS = ("states", "qk_dot", "dmimo_o", "dmimo_z", "dz")
SHAPES = [dict(B=2, S=64, H=4, N=64), dict(B=1, S=32, H=2, N=64), dict(B=2, S=64, H=4, N=128),
          dict(B=1, S=256, H=2, N=128), dict(B=1, S=256, H=2, N=16)]


def rotate(lo, hi, cos, sin, round_product=lambda x: x, fused=lambda a, b, c: a * b + c):
    """(lo cos - hi sin, lo sin + hi cos), each as one rounded product and one fused multiply-add."""
    return fused(lo, cos, -round_product(hi * sin)), fused(hi, cos, round_product(lo * sin))


def rotated_per_head(x, bias, angles, math):
    """x [B, S, R, 1, N] biased and rotated by every head's angles: [B, S, R, H, N] float64, as ``math`` rounds it."""
    B, S, R, _, N = x.shape
    H, RD = bias.shape[0], angles.shape[-1]
    half = N // 2
    x = x.expand(B, S, R, H, N)
    bias = bias.permute(1, 0, 2)[None, None]  # [1, 1, R, H, N]
    theta = angles.double()[:, :, None]  # [B, S, 1, H, RD]
    if math == "exact":
        biased, cos, sin = x.double() + bias.double(), theta.cos(), theta.sin()
        kw = {}
    elif math == "fp32":
        biased, cos, sin = x.float() + bias.float(), theta.cos().half().float(), theta.sin().half().float()
        kw = {}
    else:  # bf16: torch rounds each bf16 operation once; bf16 x bf16 products are exact in fp32
        biased, cos, sin = x.to(BF16) + bias.to(BF16), theta.cos().to(BF16), theta.sin().to(BF16)
        kw = dict(round_product=lambda t: t.to(BF16),
                  fused=lambda a, b, c: (a.float() * b.float() + c.float()).to(BF16))
    lo, hi = rotate(biased[..., :RD], biased[..., half:half + RD], cos, sin, **kw)
    out = biased.clone()
    out[..., :RD], out[..., half:half + RD] = lo, hi
    # What the products see: bf16 operands either way.
    return out if math == "exact" else out.to(BF16).double()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args(argv)
    worst = {}
    for shape, seed in itertools.product(SHAPES, range(args.seeds)):
        inputs = make_inputs(**shape, G=1, P=64, R=4, chunk_size=16, dtype=BF16, device="cpu", seed=100 + seed)
        results = {}
        for math in ("exact", "fp32", "bf16"):
            run = dict(inputs, angles=torch.zeros_like(inputs["angles"]), q_bias=torch.zeros_like(inputs["q_bias"]),
                       k_bias=torch.zeros_like(inputs["k_bias"]))
            run["q"] = rotated_per_head(inputs["q"], inputs["q_bias"], inputs["angles"], math)
            run["k"] = rotated_per_head(inputs["k"], inputs["k_bias"], inputs["angles"], math)
            results[math] = bwd_fwd_reference(**run, compute_dtype=torch.float64)
        cells = []
        for name, exact, fp32, bf16 in zip(OUTPUTS, results["exact"], results["fp32"], results["bf16"]):
            if exact is None:
                continue
            e32, e16 = ((fp32 - exact).norm() / exact.norm()).item(), ((bf16 - exact).norm() / exact.norm()).item()
            worst[name] = max(worst.get(name, 0.0), e16 / e32)
            cells.append(f"{name} {e32:.2e} -> {e16:.2e} ({e16 / e32:.2f}x)")
        label = "B{B} S{S} H{H} N{N}".format(**shape)
        print(f"{label:18s} seed {seed}: " + "; ".join(cells))
    print("worst ratio bf16 / fp32 math: " + ", ".join(f"{k} {v:.2f}x" for k, v in worst.items()))


if __name__ == "__main__":
    main()
