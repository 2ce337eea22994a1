"""Why sharded Muon ends away from one process, shown by a run (make muon-gaps).

    make muon-gaps       # about 3 minutes on 2 CPU cores: docs/results.md's "muon" section

torch.optim.Muon runs Newton-Schulz in bf16 (8 significant bits). Two ranks, three steps, two
models of two matrices: DDP + ZeroRedundancyOptimizer(torch.optim.Muon), FSDP2 +
torch.optim.Muon and 09's ZeROMuon, each against single-process torch.optim.Muon, with torch's
bf16 iteration and with the same iteration in fp32 (`fp32_newton_schulz`). For each it counts the
elements of the first step's Newton-Schulz inputs whose bf16 value differs from one process's:
a data-parallel gradient is summed in another order, and once in a while an element rounds to
another bf16 value. Then FSDP2 after one step, matrix by matrix: with the same inputs it differs
on a matrix taller than wide, which Newton-Schulz transposes. In fp32 every gap falls to fp32
round-off: each strategy does the whole-matrix arithmetic, and the bf16 gaps are rounding.
"""
import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from lessonkit import lifecycle
from scripts.learn.results import machine, write_section
from scripts.runs import Parser, load_lesson, tool_main

STEPS, LR, WORLD = 3, 0.02, 2
# two models of two matrices: the small one's gradients round to the same bf16 inputs as one
# process's, the larger one's do not all
MODELS = [(32, 64, 16), (128, 512, 128)]
STRATEGIES = ("ZeroRedundancyOptimizer", "FSDP2", "09 ZeROMuon")


@contextlib.contextmanager
def fp32_newton_schulz():
    """torch.optim.Muon with its Newton-Schulz iteration in fp32 instead of bf16: the same
    coefficients and steps, the same transposes (tests/test_09_muon.py uses it too)."""
    from torch.optim import _muon

    def iterate(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
        x = x / x.norm().clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if grad.size(0) > grad.size(1) else x
    original, _muon._zeropower_via_newtonschulz = _muon._zeropower_via_newtonschulz, iterate
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


@contextlib.contextmanager
def recording(inputs):
    """Keep in `inputs` what each Newton-Schulz call is handed, whole (a DTensor gathered), rounded to
    bf16 as torch's iteration rounds it first: {(matrix shape, its n-th call): tensor}."""
    from torch.optim import _muon
    original = _muon._zeropower_via_newtonschulz

    def record(grad, *args):
        whole = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        calls = sum(shape == tuple(whole.shape) for shape, _ in inputs)
        inputs[(tuple(whole.shape), calls)] = whole.detach().bfloat16().clone()
        return original(grad, *args)
    _muon._zeropower_via_newtonschulz = record
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


# ----------------------------------------------------------------------------- part 2
def model(widths):
    torch.manual_seed(0)
    a, b, c = widths
    return nn.Sequential(nn.Linear(a, b, bias=False), nn.Tanh(), nn.Linear(b, c, bias=False))


def batch(step, widths):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, widths[0], generator=g), torch.randn(8, widths[-1], generator=g)


def train(m, opt, forward, widths, rank=0, world=1, steps=STEPS):
    for step in range(steps):
        x, y = batch(step, widths)
        n = len(x) // world
        ((forward(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in m.parameters()]


def single(fp32, widths, steps=STEPS):
    inputs = {}
    with fp32_newton_schulz() if fp32 else contextlib.nullcontext(), recording(inputs):
        m = model(widths)
        return train(m, torch.optim.Muon(m.parameters(), lr=LR), m, widths, steps=steps), inputs


def _rank(rank, strategy, fp32, widths, steps, store_path, out):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    inputs = {}
    with fp32_newton_schulz() if fp32 else contextlib.nullcontext(), recording(inputs):
        m = model(widths)
        if strategy == "ZeroRedundancyOptimizer":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel
            forward, opt = DistributedDataParallel(m), ZeroRedundancyOptimizer(m.parameters(), torch.optim.Muon, lr=LR)
        elif strategy == "FSDP2":
            from torch.distributed.fsdp import fully_shard
            for layer in m:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            forward, opt = fully_shard(m), torch.optim.Muon(m.parameters(), lr=LR)
        else:  # 09's optimizer, as a drop-in: its own reduce-scatter, so no DDP
            zero_muon = load_lesson("09_muon").ZeROMuon
            forward, opt = m, zero_muon([{"params": list(m.parameters()), "use_muon": True}], muon_defaults=dict(lr=LR))
        params = train(m, opt, forward, widths, rank, WORLD, steps)
    torch.save({"params": params, "inputs": inputs}, f"{out}.{rank}")  # (owners: the matrices each owns)
    lifecycle.exit_process(0)  # not a return: gloo can abort in interpreter teardown (lifecycle says)


def sharded(strategy, fp32, widths, steps=STEPS):
    """(rank 0's parameters, every rank's Newton-Schulz inputs)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        mp.start_processes(_rank, args=(strategy, fp32, widths, steps, os.path.join(tmp, "store"), out), nprocs=WORLD,
                           start_method="spawn")
        ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    return ranks[0]["params"], {k: v for r in ranks for k, v in r["inputs"].items()}


def gaps(widths):
    """{(strategy, "bf16" | "fp32"): (the largest |parameter - one process's| at the end, how many
    elements of the first step's Newton-Schulz inputs, in bf16, differ from one process's, of how many)}."""
    out = {}
    for fp32 in (False, True):
        ref, ref_inputs = single(fp32, widths)
        for strategy in STRATEGIES:
            got, inputs = sharded(strategy, fp32, widths)
            assert inputs.keys() == ref_inputs.keys(), (strategy, sorted(inputs), sorted(ref_inputs))
            first = [k for k in inputs if k[1] == 0]  # the first step's, before any parameter differs
            flips = sum((inputs[k] != ref_inputs[k]).sum().item() for k in first)
            out[(strategy, "fp32" if fp32 else "bf16")] = (max((a - b).abs().max().item() for a, b in zip(got, ref)),
                                                           flips, sum(inputs[k].numel() for k in first))
    return out


def main(argv=None):
    p = Parser("muon_gaps", description=__doc__)
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/results.md")
    a = p.parse_args(argv)
    if not hasattr(torch.optim, "Muon"):
        p.error(f"torch.optim.Muon is in PyTorch 2.9 and later; this is torch {torch.__version__}")
    rows = ["| model | strategy | max abs diff, bf16 Newton-Schulz (torch's) | step 1's bf16 inputs differing "
            "| max abs diff, fp32 Newton-Schulz |", "|---|---|---|---|---|"]
    for widths in MODELS:
        gap = gaps(widths)
        rows += [f"| {'-'.join(map(str, widths))} | {s} | {gap[(s, 'bf16')][0]:.1e} | {gap[(s, 'bf16')][1]} of "
                 f"{gap[(s, 'bf16')][2]} | {gap[(s, 'fp32')][0]:.1e} |" for s in STRATEGIES]
    # FSDP2 after one step, matrix by matrix: its Newton-Schulz works on a tall matrix's transpose
    one = [(tuple(a.shape), (a - b).abs().max().item())
           for a, b in zip(sharded("FSDP2", False, MODELS[0], 1)[0], single(False, MODELS[0], 1)[0])]
    body = "\n".join([
        "## Muon: sharded against one process", "",
        f"Machine: {machine()}. `make muon-gaps`: {WORLD} ranks, gloo, {STEPS} steps of torch.optim.Muon (lr {LR}) "
        "on two-matrix models (widths in-hidden-out), each against one process.",
        "", *rows, "",
        f"FSDP2, {'-'.join(map(str, MODELS[0]))}, after one step, max abs diff per matrix (rows x columns): " + ", ".join(
            f"{m} x {n} {'(tall: transposed in Newton-Schulz)' if m > n else '(wide)'} {d:.1e}"
            for (m, n), d in one) + "."])
    print(body)
    if not a.no_write:
        write_section("muon", body)
    return 0


if __name__ == "__main__":
    sys.exit(tool_main("muon_gaps", main))
