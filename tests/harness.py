"""Test plumbing: run a function on N spawned ranks (gloo, CPU, a free port), train the
single-process reference every lesson is held to, compare runs with it (tolerances: tolerances.py),
and what the replicated lessons' tests (01-03) share. (Loading a graded file: graded.py.)"""
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
import forkserver  # noqa: E402
from graded import ROOT, load_lesson  # noqa: E402  (ROOT: also the tests')
from lessons import build, zero3_full_parameters  # noqa: E402
from tolerances import BF16_LOSS_TOL, BF16_PARAM_TOL  # noqa: E402
from toy import toy_train  # noqa: E402


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


_FORKSERVER = forkserver.CONTEXT  # (forkserver.py says why the ranks fork from a server)


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


def of_lesson(case):
    """`make test LESSON=0N`: is the parametrized case ("05", "05_bf16", "toy_05_chunk", ...) one of
    that lesson's? Every case when LESSON is unset. A launch shared by a file's tests builds only
    these (its ranks inherit LESSON), so one lesson's tests do not wait for every lesson's runs."""
    lesson, case = os.environ.get("LESSON", ""), case.removeprefix("toy_")
    return not lesson or case == lesson or case.startswith(f"{lesson}_")


def launches(suite):
    """A test file's `results(world)`: each rank's `suite(world)`, launched on `world` ranks once
    per world size (start-up is costly; a failed launch is remembered too: once)."""
    @once
    def results(world):
        return spawn(world, suite, world)
    return results


PEAKS = ["--peak-params", "1"]  # run_lesson's argv: sample memory after every op (peak_params, peak_grads)


def run_lesson(lesson, argv):
    """In a spawned rank: run a lesson's main() with these flags; return what tests compare.
    A sharded model (06's) is gathered (lessons.zero3_full_parameters); others are read as they are.
    Memory is sampled after every operation of the measured step (--peak-params 1: about 2 s of a
    small run's 0.1 s) only where argv asks for it, in the runs whose peaks a test reads."""
    if "--peak-params" not in argv:
        argv = [*argv, "--peak-params", "0"]
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
    """Ring bytes one rank sends per step, issued: the payloads it asked for times the ring factor."""
    return report["comm"]["issued_ring_bytes_per_step"]


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
    what every lesson must reproduce. Uses the same flags, model, data and optimizer, and in fp16
    the same loss scaler (alone: no process group here, so its found-inf flag is this process's)."""
    from lessonkit import common, loss_scale, optimizers
    from model import global_batch
    args = common.parse_args(argv)
    # bf16: fp32 master weights from the fp32 initial weights, as every lesson (common.build_model)
    model = common.build_model(args, common.Dist(0, 1, torch.device("cpu"), "gloo"))
    opt = optimizers.MixedPrecisionAdamW(optimizers.decay_groups(model, args.weight_decay), args.grad_clip,
                                     **optimizers.adamw_kwargs(args))
    # fp16's loss scaler, else the identity
    scaler = loss_scale.LossScaler("cpu", enabled=args.precision == "fp16", init_scale=args.loss_scale)
    losses = []
    for step in range(steps or args.steps):
        tokens = global_batch(args.seed, step, args.global_batch, args.seq_len, args.vocab_size)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        scaler.scale(loss).backward()
        optimizers.set_learning_rate(opt, args, step)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "loss_scale": scaler.report(),  # (fp16: the steps it skipped; else None)
            "params": {n: p.detach().float().clone() for n, p in model.named_parameters()}}


def gpt_train(lesson, argv, **kw):
    """In a spawned rank: train the GPT of `argv` through the tests' adapter (tests/lessons.py),
    e.g. PyTorch's DDP on exactly the configuration a lesson's main() runs (kw: build's)."""
    from lessonkit import common
    from model import get_batch
    args = common.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    env = common.Dist(rank, world, torch.device("cpu"), "gloo")
    model = common.build_model(args, env)
    trainer = build(lesson, model, grad_clip=args.grad_clip, lr=args.lr, bucket_mb=args.bucket_mb,
                    weight_decay=args.weight_decay, reduce_every=args.reduce_every,
                    all_reduce_every=args.all_reduce_every, **kw)
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


def toy_grads(lesson, **kw):
    """In a spawned rank: toy.toy_train(lesson, **kw), with the gradients the optimizer is handed
    at each step (recording) under "grads"."""
    grads = []
    out = toy_train(recording(build, grads), lesson, **kw)
    return {**out, "grads": grads}


def toy_reference_grads(steps=4, lr=1e-2):
    """The whole-batch gradient at every step of toy.toy_reference()."""
    from lessonkit import optimizers
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
    """Two runs ({"losses", "params"}) agree within `tol` (tests/tolerances.py says why)."""
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


def all_close(want, results, keys, tol):
    """On every rank, each run named in `keys` agrees with `want` within `tol` (close), the rank
    and the key named in a failure. A key is an entry of the rank's results, or a path into them
    (("gpt_caps", 2): 03's run at the cap that makes 2 buckets)."""
    for rank, rank_out in enumerate(results):
        for key in keys:
            run = rank_out
            for part in key if isinstance(key, tuple) else (key,):
                run = run[part]
            try:
                close(run, want, tol)
            except AssertionError as e:
                raise AssertionError(f"rank {rank}, {key}: {e}") from None


def bf16_close(a, b):
    """bf16 parity of a replicated lesson (02, 03) with the bf16 reference, element by element
    (tolerances.BF16_*)."""
    torch.testing.assert_close(a["losses"], b["losses"], **BF16_LOSS_TOL)
    assert a["params"].keys() == b["params"].keys()
    for name, p in a["params"].items():
        torch.testing.assert_close(p, b["params"][name], **BF16_PARAM_TOL, msg=name)


# ----------------------------------------------------------------------------- 01-03 beside DDP
def replicated_runs(lesson, argv):
    """In a spawned rank: the runs each replicated lesson (01-03, by file name) is held to the
    reference and to DDP on: main() with and without accumulation, DDP on the same GPT; the toy
    with ranks starting different, with 3 micro-steps, and under DDP."""
    number = lesson[:2]
    return {
        "main": run_lesson(lesson, argv),
        "accum": run_lesson(lesson, argv + ["--grad-accum", "2"]),
        "ddp": gpt_train("ddp", argv),
        "toy": toy_train(build, number, different_init=True, find_unused=True),
        "toy_accum": toy_train(build, number, grad_accum=3, find_unused=True),
        "toy_ddp": toy_train(build, "ddp", find_unused=True),
    }


REPLICATED_GPT, REPLICATED_TOY = ("main", "accum", "ddp"), ("toy", "toy_accum", "toy_ddp")


def one_all_reduce_per_tensor(main, world):
    """main()'s measured step in 01 and 02 (fp32): only all-reduces, one per parameter tensor
    with a gradient (the tied embedding/head counts once), and a ring all-reduce's bytes."""
    report = main["report"]
    psi = report["n_params"]
    ops = comm_ops(report)
    assert list(ops) == ["all_reduce"]
    assert ops["all_reduce"]["bytes"] == psi * 4  # exact: every gradient once, fp32
    assert ops["all_reduce"]["calls"] == len(main["params"])
    assert sent_bytes(report) == theory_bytes(report)
    assert sent_bytes(report) == 2 * (world - 1) / world * psi * 4


def replicated_bf16_memory(report, psi, n_tensors):
    """A replicated lesson's bf16 run (02, 03): ring bytes and memory at rest as the ZeRO paper
    says, 2 + 2 + 12 Psi, measured from the live tensors rank by rank."""
    assert sent_bytes(report) == theory_bytes(report)
    theory = memory_theory(report)
    assert (theory["params"], theory["grads"], theory["optimizer"]) == (2 * psi, 2 * psi, 12 * psi)
    for mem in held(report):
        assert mem["params"] == 2 * psi and mem["peak_params"] == 2 * psi
        assert mem["grads"] == 2 * psi
        # fp32 master weights and two fp32 moments: 12 Psi. torch's AdamW also keeps one 0-dim
        # fp32 step counter per parameter tensor (4 bytes each), which the ZeRO paper's K omits.
        assert mem["optimizer"] == 12 * psi + 4 * n_tensors
        assert mem["other"] == 0
