import dataclasses, torch, sys
sys.path.insert(0, ".")
import mamba3_mimo.api as api
from mamba3_mimo.inputs import make_inputs
from mamba3_mimo.ops.production import choose_config
from mamba3_mimo.bench import parse_case
BF16 = torch.bfloat16
for case, z in (("N128_P64_R1_C64", True), ("N128_P64_R2_C32", False), ("N16_P64_R4_C8", True)):
    sizes = parse_case(case)
    chosen = choose_config(B=4, H=16, S=2048, num_sms=torch.cuda.get_device_properties(0).multi_processor_count, has_z=z, **sizes)
    inputs = make_inputs(B=4, S=2048, H=16, G=1, **sizes, dtype=BF16, z=z, d=True, device="cuda", seed=7)
    plain = api.bwd_fwd(**inputs, output_dtype=BF16, config=chosen)
    plain2 = api.bwd_fwd(**inputs, output_dtype=BF16, config=chosen)
    for cfg_name, cfg in (("pdl", dataclasses.replace(chosen, pdl=True)), ("pdl_nofold", dataclasses.replace(chosen, pdl=True, fold_one_scan=False))):
        for rep in range(2):
            dep = api.bwd_fwd(**inputs, output_dtype=BF16, config=cfg)
            torch.cuda.synchronize()
            q0, q1 = plain[1].float(), dep[1].float()
            diff = (q0 - q1).abs()
            bad = (diff > 0).nonzero()
            print(case, "Z" if z else "noZ", cfg_name, rep, "plain-repeat-equal", torch.equal(plain[1], plain2[1]),
                  "qk ndiff", int((diff > 0).sum()), "of", q0.numel(), "maxdiff", float(diff.max()), "max|qk|", float(q0.abs().max()),
                  "first", bad[:3].tolist(), "others equal", [torch.equal(a, b) for a, b in zip(plain, dep) if a is not None])
