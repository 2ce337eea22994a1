"""Test plumbing: run a function on N spawned ranks (gloo, CPU, a free port), and train the
single-process reference every lesson is held to. (Loading a graded file: graded.py.)"""
import functools
import os
import random
import sys
import tempfile
import time
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

# Which files are graded and where they are read from (this checkout or a student edition):
# the course kit's own module, tests/graded.py.
from graded import ROOT, load_lesson  # noqa: E402  (ROOT: also the tests')
from lessons import zero3_full_parameters  # noqa: E402


def _worker(rank, world, port, fn, args, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    # Forked ranks would all inherit the server's generator states: draw new ones, as a new
    # interpreter does, so code that draws without a seed differs between ranks here as well.
    torch.seed()
    random.seed()
    code = 0
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        result = fn(*args)
        torch.save({"ok": result}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # report it to the parent, whatever it was
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # see lifecycle.exit_process: avoids gloo's rare abort at interpreter exit


# Ranks are forked from a server process that has imported torch once, and torch._dynamo, which
# the first optimizer step of every process imports (forkserver, with those preloaded): a rank
# then starts in well under a second instead of about 4 s, and the suite runs dozens of them.
# Forked ranks share what the server had: its environment (from the first launch) and its hash
# seed. So each rank starts as a new interpreter instead (spawn) with `fresh=True`, and whenever
# graded files come from elsewhere (DP_LESSONS: set before or during the run, and
# a student's code must meet what torchrun gives it, a hash seed of its own included).
_FORKSERVER = mp.get_context("forkserver")
_FORKSERVER.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])


def spawn(world, fn, *args, timeout=300, fresh=False):
    """Run fn(*args) on `world` ranks inside an initialised gloo group; return each rank's
    result. fn must be a module-level function (it is pickled by name)."""
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    elsewhere = os.path.abspath(os.environ.get("DP_LESSONS") or ROOT) != ROOT
    fresh = fresh or bool(elsewhere)  # (read now: a test may set DP_LESSONS after the first launch)
    ctx = mp.get_context("spawn") if fresh else _FORKSERVER
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_worker, args=(r, world, store.port, fn, args, out_dir))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout  # for all ranks together, not each in turn
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if hung:
            raise TimeoutError(f"ranks {hung} of {world} still running after {timeout}s")
        results = []
        errors = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited {procs[r].exitcode} without a result")
                continue
            out = torch.load(path, weights_only=False)
            if "error" in out:
                errors.append(f"rank {r}:\n{out['error']}")
            else:
                results.append(out["ok"])
        if errors:
            # When one rank fails the others often only see "connection closed": show them all.
            raise RuntimeError("\n".join(errors))
        return results


def once(fn):
    """functools.lru_cache for a test file's `results(world)`, remembering a failure too: a
    lesson that fails to run (a student's NotImplementedError) fails every test that reads its
    results with the same message, without launching the ranks again for each one."""
    memo = {}

    @functools.wraps(fn)
    def cached(*args):
        if args not in memo:
            try:
                memo[args] = (fn(*args), None)
            except Exception as e:
                memo[args] = (None, e)
        value, error = memo[args]
        if error is not None:
            raise error
        return value
    return cached


def run_lesson(lesson, argv):
    """In a spawned rank: run a lesson's main() with these flags; return what tests compare.
    A sharded model (06's) is gathered (lessons.zero3_full_parameters); others are read as they are."""
    run = load_lesson(lesson).main(argv)
    sharded = next((h for h in run.ledger.roots if hasattr(h, "units")), None)
    params = (zero3_full_parameters(sharded) if sharded else
              {n: p.detach().float().clone() for n, p in run.model.named_parameters()})
    return {"losses": run.losses, "params": params, "report": run.final_report}


# ----------------------------------------------------------------------------- reading a report
def comm_ops(report):
    """{collective: {"calls", "bytes"}}: what rank 0 issued in the measured step."""
    return report["comm"]["ops"]


def sent_bytes(report):
    """Ring bytes one rank sends per step, measured."""
    return report["comm"]["ring_bytes_per_step"]


def theory_bytes(report):
    """Ring bytes one rank sends per step, by the ZeRO paper's formula."""
    return report["comm"]["theory_ring_bytes_per_step"]


def held(report):
    """Per rank, the bytes held at rest by category (params, grads, optimizer, ...), measured."""
    return report["memory"]["per_rank"]


def memory_theory(report):
    """The ZeRO paper's bytes per rank for this stage, world size and precision."""
    return report["memory"]["theory"]


class PeakAlive(TorchDispatchMode):
    """The most bytes held at once by tensors created while it is active, sampled after every
    tensor operation (each storage once; a freed storage counts zero). Observes a construction
    from outside, e.g. ZeRO-3 (06) materialising a model one unit at a time: everything it
    allocates counts, shards, full units and the initialiser's temporaries alike."""

    def __init__(self):
        super().__init__()
        self.alive, self.peak = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (list, tuple)) else [out]):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.alive.append(weakref.ref(t))
        self.alive = [r for r in self.alive if r() is not None]
        storages = {}
        for r in self.alive:
            t = r()
            if t is not None and t.untyped_storage().nbytes():
                storages[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
        self.peak = max(self.peak, sum(storages.values()))
        return out


# ----------------------------------------------------------------------------- the reference
def reference(argv, steps=None):
    """Single-process training on the whole global batch (no accumulation, no distribution):
    what every lesson must reproduce. Uses the same flags, model, data and optimizer."""
    import common
    import optimizers
    from model import global_batch
    args = common.parse_args(argv)
    # bf16: fp32 master weights from the fp32 initial weights, as every lesson (common.build_model)
    model = common.build_model(args, common.Dist(0, 1, torch.device("cpu"), "gloo"))
    opt = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, args.weight_decay), args.grad_clip,
                                     **optimizers.adamw_kwargs(args))
    losses = []
    for step in range(steps or args.steps):
        tokens = global_batch(args.seed, step, args.global_batch, args.seq_len, args.vocab_size)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizers.set_learning_rate(opt, args, step)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses,
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def gpt_train(lesson, argv):
    """In a spawned rank: train the GPT of `argv` through the tests' adapter (tests/lessons.py),
    e.g. PyTorch's DDP on exactly the configuration a lesson's main() runs."""
    import common
    from lessons import build
    from model import get_batch
    args = common.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    env = common.Dist(rank, world, torch.device("cpu"), "gloo")
    model = common.build_model(args, env)
    trainer = build(lesson, model, grad_clip=args.grad_clip, lr=args.lr, bucket_mb=args.bucket_mb,
                    weight_decay=args.weight_decay)
    losses = []
    for step in range(args.steps):
        batches = [get_batch(args, env, step, m) for m in range(args.grad_accum)]
        loss = torch.tensor(trainer.train_step(batches))
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return {"losses": losses, "params": trainer.full_parameters()}


# ----------------------------------------------------------------------------- gradients
def recording(build, grads, storages=None):
    """Wrap a `build` (tests/lessons.py) so that each step appends to `grads` the gradients the
    optimizer is about to use, {name: fp32 copy}, and to `storages` the set of (data_ptr, nbytes)
    of the storages they live in. Why gradients: Adam's update m/sqrt(v) ignores a common scale
    of the gradients, so a missing 1/N hides in the parameters and shows only here."""
    def build_recording(lesson, module, **kw):
        trainer = build(lesson, module, **kw)
        step = trainer.opt.step

        def record_then_step():
            named = [(n, p.grad) for n, p in module.named_parameters() if p.grad is not None]
            grads.append({n: g.detach().float().clone() for n, g in named})
            if storages is not None:
                storages.append({(g.untyped_storage().data_ptr(), g.untyped_storage().nbytes())
                                 for _, g in named})
            step()
        trainer.opt.step = record_then_step
        return trainer
    return build_recording


def toy_reference_grads(steps=4, lr=1e-2):
    """The whole-batch gradient at every step of toy.toy_reference()."""
    import optimizers
    from lessons import adamw
    from toy import make_toy, toy_batch
    model = make_toy(seed=0)
    opt = optimizers.MixedPrecisionAdamW(model.parameters(), 0.0, **adamw(lr))
    grads = []
    for step in range(steps):
        model(*toy_batch(step)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return grads


# ----------------------------------------------------------------------------- comparisons
def close(a, b, tol):
    """Two runs ({"losses", "params"}) agree within `tol` (each test file says why its tol)."""
    torch.testing.assert_close(a["losses"], b["losses"], **tol)
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        torch.testing.assert_close(a["params"][name], b["params"][name], **tol, msg=name)


def grads_close(got, want, tol):
    """Per-step gradients agree; a parameter with no gradient in `want` has none or zeros."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        for name in w:
            torch.testing.assert_close(g[name], w[name], **tol, msg=f"step {step} {name}")
        for name in g.keys() - w.keys():
            assert not g[name].any(), f"step {step} {name}: a gradient out of nothing"
