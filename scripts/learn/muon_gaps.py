"""Why sharded Muon ends away from one process, shown by a run (make muon-gaps).

    make muon-gaps       # about 30 s on 2 CPU cores: docs/results.md's "muon" section

torch.optim.Muon runs Newton-Schulz in bf16 (8 significant bits). Any data-parallel run sums its
ranks' gradients in another order than one process does, so its gradient differs from one
process's in the last fp32 bits (about 1e-7, relative). Most elements round to the same bf16
value, a few round the other way, and five Newton-Schulz iterations spread and grow those
differences into the update. The run shows it in two parts:

1. One gradient, Newton-Schulz on it and on the same gradient changed by one fp32 rounding per
   element: how far the two results are, in bf16 (torch's) and in fp32.
2. Two ranks, three steps on a two-matrix model: DDP + ZeroRedundancyOptimizer(torch.optim.Muon),
   FSDP2 + torch.optim.Muon and 09's ZeROMuon, each against single-process torch.optim.Muon, with
   torch's bf16 Newton-Schulz and with the same iteration in fp32 (`fp32_newton_schulz`). In fp32
   every gap falls to fp32 round-off: each strategy does the whole-matrix arithmetic, and the
   gap in bf16 is Newton-Schulz's rounding, not a wrong matrix.
"""
import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from scripts.learn.results import machine, write_section
from scripts.runs import Parser, load_lesson, tool_main

STEPS, LR, WORLD = 3, 0.02, 2
WIDTHS = [int(w) for w in os.environ.get("MUON_GAPS_WIDTHS", "32,64,16").split(",")]
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
def model():
    torch.manual_seed(0)
    a, b, c = WIDTHS
    return nn.Sequential(nn.Linear(a, b, bias=False), nn.Tanh(), nn.Linear(b, c, bias=False))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, WIDTHS[0], generator=g), torch.randn(8, WIDTHS[-1], generator=g)


def train(m, opt, forward, rank=0, world=1, steps=STEPS):
    for step in range(steps):
        x, y = batch(step)
        n = len(x) // world
        ((forward(x[rank * n:(rank + 1) * n]) - y[rank * n:(rank + 1) * n]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in m.parameters()]


def single(fp32, steps=STEPS):
    inputs = {}
    with fp32_newton_schulz() if fp32 else contextlib.nullcontext(), recording(inputs):
        m = model()
        return train(m, torch.optim.Muon(m.parameters(), lr=LR), m, steps=steps), inputs


def _rank(rank, strategy, fp32, steps, store_path, out):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    inputs = {}
    with fp32_newton_schulz() if fp32 else contextlib.nullcontext(), recording(inputs):
        m = model()
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
        params = train(m, opt, forward, rank, WORLD, steps)
    torch.save({"params": params, "inputs": inputs}, f"{out}.{rank}")  # (owners: the matrices each owns)
    dist.destroy_process_group()


def sharded(strategy, fp32, steps=STEPS):
    """(rank 0's parameters, every rank's Newton-Schulz inputs)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        mp.start_processes(_rank, args=(strategy, fp32, steps, os.path.join(tmp, "store"), out), nprocs=WORLD,
                           start_method="spawn")
        ranks = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    return ranks[0]["params"], {k: v for r in ranks for k, v in r["inputs"].items()}


def gaps():
    """{(strategy, "bf16" | "fp32"): (the largest |parameter - one process's| at the end, how many
    elements of the first step's Newton-Schulz inputs, in bf16, differ from one process's, of how many)}."""
    out = {}
    for fp32 in (False, True):
        ref, ref_inputs = single(fp32)
        for strategy in STRATEGIES:
            got, inputs = sharded(strategy, fp32)
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
    gap = gaps()
    # FSDP2 after one step, matrix by matrix: its Newton-Schulz works on a tall matrix's transpose
    one = [(tuple(a.shape), (a - b).abs().max().item()) for a, b in zip(sharded("FSDP2", False, 1)[0], single(False, 1)[0])]
    rows = ["| strategy | max abs parameter difference, bf16 Newton-Schulz (torch's) | step 1's bf16 inputs that differ "
            "| max abs difference, fp32 Newton-Schulz |", "|---|---|---|---|"]
    rows += [f"| {s} | {gap[(s, 'bf16')][0]:.1e} | {gap[(s, 'bf16')][1]} of {gap[(s, 'bf16')][2]} | {gap[(s, 'fp32')][0]:.1e} |"
             for s in STRATEGIES]
    body = "\n".join([
        "## Muon: sharded against one process", "",
        f"Machine: {machine()}. `make muon-gaps` (scripts/learn/muon_gaps.py): {WORLD} ranks, gloo, {STEPS} steps of "
        f"torch.optim.Muon (lr {LR}) on a {WIDTHS} model of two matrices, each against one process.", "", *rows, "",
        "FSDP2 after one step, max abs difference per matrix (rows x columns, sharded by rows): " + ", ".join(
            f"{m} x {n} {'(taller than wide: transposed inside Newton-Schulz)' if m > n else '(wide)'} {d:.1e}"
            for (m, n), d in one) + "."])
    print(body)
    if not a.no_write:
        write_section("muon", body)
    return 0


if __name__ == "__main__":
    sys.exit(tool_main("muon_gaps", main))
