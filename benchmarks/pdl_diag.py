"""How a call with ``ScanConfig.pdl`` differs from the same config without it, on the GPU (docs/optimization.md 40).

    python benchmarks/pdl_diag.py

For three official shapes: whether two plain calls agree, and per PDL call how many qk_dot elements differ from the
plain call, by how much, and which other outputs are bitwise equal.  On an H100 the differences were one bf16 ulp in
10-13% of qk_dot at R <= 2, the same in every call: an arithmetic order the wait changes, not a race.
"""
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mamba3_mimo.api as api  # noqa: E402
from mamba3_mimo.bench import parse_case  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.ops.production import choose_config  # noqa: E402

CASES = (("N128_P64_R1_C64", True), ("N128_P64_R2_C32", False), ("N16_P64_R4_C8", True))


def main():
    bf16 = torch.bfloat16
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for case, z in CASES:
        sizes = parse_case(case)
        chosen = choose_config(B=4, H=16, S=2048, num_sms=num_sms, has_z=z, **sizes)
        inputs = make_inputs(B=4, S=2048, H=16, G=1, **sizes, dtype=bf16, z=z, d=True, device="cuda", seed=7)
        plain = api.bwd_fwd(**inputs, output_dtype=bf16, config=chosen)
        repeat = api.bwd_fwd(**inputs, output_dtype=bf16, config=chosen)
        variants = (("pdl", dataclasses.replace(chosen, pdl=True)),
                    ("pdl_nofold", dataclasses.replace(chosen, pdl=True, fold_one_scan=False)))
        for name, config in variants:
            for call in range(2):
                dependent = api.bwd_fwd(**inputs, output_dtype=bf16, config=config)
                diff = (plain[1].float() - dependent[1].float()).abs()
                print(case, "Z" if z else "noZ", name, call, "plain calls equal", torch.equal(plain[1], repeat[1]),
                      "qk_dot differing", int((diff > 0).sum()), "of", diff.numel(), "max diff", float(diff.max()),
                      "max |qk_dot|", float(plain[1].float().abs().max()), "first", (diff > 0).nonzero()[:3].tolist(),
                      "outputs equal", [torch.equal(a, b) for a, b in zip(plain, dependent) if a is not None])


if __name__ == "__main__":
    main()
