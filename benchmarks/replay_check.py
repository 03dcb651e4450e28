"""Which official-size calls are replayed whole (ops/launch.py), and where a recording gives up, why.

usage: python benchmarks/replay_check.py [--no-z] [--span-shapes 64x64,128x32] [CASE ...]
       (GPU; default: the official grid and the dispatcher's spans)

For each case it makes three dispatcher calls on fresh inputs and prints whether the second and third were
replayed (no host wrapper ran).  Where the first call's recording turned unreplayable, it names the launch (kernel
and argument position) or the torch op (``forbid_replay``) that did it.  The eager benchmark's time over the graph
replay's is the symptom; this says which rule caused it (docs/optimization.md section 57).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mamba3_mimo import api  # noqa: E402
from mamba3_mimo.bench import OFFICIAL_CASES, parse_case  # noqa: E402
from mamba3_mimo.inputs import make_inputs  # noqa: E402
from mamba3_mimo.ops import launch  # noqa: E402


def check(case, has_z):
    shape = parse_case(case)
    causes, replays = [], []
    add, forbid, run = launch._CallRecord.add, launch.forbid_replay, launch._CallRecord.run

    def spying_add(self, compiled, trailing, grid, device, args):
        was = self.replayable
        add(self, compiled, trailing, grid, device, args)
        if was and not self.replayable:
            name = getattr(getattr(compiled, "metadata", None), "name", None) or getattr(compiled, "name", compiled)
            causes.append(f"launch of {name}: an argument the call record cannot describe (_CallRecord.add)")

    def spying_forbid():
        plan = launch._active_plan.get()
        if plan is not None and plan.recording is not None and plan.recording.replayable:
            causes.append("forbid_replay (a torch op between launches)")
        forbid()

    launch._CallRecord.add, launch.forbid_replay = spying_add, spying_forbid
    launch._CallRecord.run = lambda self, roots: (replays.append(1), run(self, roots))[1]
    # bwd_fwd's modules look forbid_replay up at call time through the launch module only where they import it
    # that way; patch the names they hold as well.
    patched = []
    for module in list(sys.modules.values()):
        named = getattr(module, "__name__", "") or ""
        if named.startswith("mamba3_mimo.") and getattr(module, "forbid_replay", None) is forbid:
            patched.append(module)
            module.forbid_replay = spying_forbid
    try:
        launch._calls.clear()
        for seed in range(3):
            inputs = make_inputs(B=4, S=2048, H=16, G=1, dtype=torch.bfloat16, device="cuda", seed=seed, z=has_z,
                                 d=True, **shape)
            api.bwd_fwd(**inputs, output_dtype=torch.bfloat16)
            if seed == 0 and not launch._calls and not causes:
                causes.append("the first call was not recorded (no plan, aliased roots or no launch)")
        torch.cuda.synchronize()
    finally:
        launch._CallRecord.add, launch.forbid_replay, launch._CallRecord.run = add, forbid, run
        for module in patched:
            module.forbid_replay = forbid
    return len(replays), causes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(OFFICIAL_CASES))
    parser.add_argument("--no-z", action="store_true")
    parser.add_argument("--span-shapes", default=None, metavar="NxP,...",
                        help="the (N, P) pairs whose fused pass's end pass takes spans (default: the dispatcher's)")
    args = parser.parse_args()
    if args.span_shapes is not None:
        from mamba3_mimo.ops import production

        production.SCAN_OUTPUTS_END_SPAN_SHAPES = tuple(
            tuple(int(size) for size in pair.split("x")) for pair in args.span_shapes.split(",") if pair)
    os.environ.pop("MAMBA3_MIMO_CHECK_PLAN", None)  # the plan check runs every call's wrappers: no replay
    for case in args.cases:
        replayed, causes = check(case, not args.no_z)
        print(f"{case:18s} z={not args.no_z!s:5s} replayed {replayed} of 2 later calls"
              + (f"; recording stopped: {'; '.join(causes)}" if causes else ""), flush=True)


if __name__ == "__main__":
    main()
