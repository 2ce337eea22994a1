"""Checkpoints (checkpoint.py, --checkpoint-dir/--save-every/--resume): exact resume for every
lesson, resume at another world size, consolidation into a plain GPT state_dict, refusals.

Five launches: world 2 does every lesson's uninterrupted run (saving at steps 2, 4, 6), its
resumed run, bf16, the refusals and the toy model; worlds 4, 2 again, 1 and 3 resume from those
checkpoints. The uninterrupted run is the reference: a resumed run must give its losses. 08
(R x G grids) rides along: world 4 runs it at 2 x 2, worlds 2 and 1 resume it at other grids.
"""
import functools
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lessonkit import checkpoint, common, reshard
from graded import lesson_file
from harness import ROOT, reference, run_lesson, spawn
from lessons import build, handles
from model import GPT, get_batch
from scripts.learn.consolidate import consolidate
from toy import BATCH, make_toy, toy_batch
from zero_parity import close, identical

LESSONS = ["01_vanilla_dp", "02_async_allreduce", "03_buckets", "04_zero1", "05_zero2", "06_zero3", "07_offload"]
SHARDED = LESSONS[3:]
# Psi = d (V + T + 2 + L (12 d + 13)) = 35 x 949 = 33,215, and each ZeRO-3 unit (35 x 83, 35 x 433)
# too, is odd and not a multiple of 3: at 2, 3 and 4 ranks every flat buffer is padded. 12
# sequences divide among 1, 2, 3 and 4 ranks.
ARGV = ["--steps", "6", "--n-layer", "2", "--d-model", "35", "--n-head", "5", "--vocab-size", "65",
        "--seq-len", "16", "--global-batch", "12", "--peak-params", "0", "--log-every", "100"]
PSI = 33_215
SAVE = ["--save-every", "2"]
BF16 = ["--precision", "bf16"]
TOY_LESSONS = ["01", "04", "05", "06"]
# any torch.optim optimizer's state is checkpointed: SGD's momentum buffers too (once AdamW's only:
# saving SGD's ended in KeyError 'step', as it counts no steps)
MOMENTUM = dict(optimizer_class=torch.optim.SGD, optimizer_kwargs=dict(lr=0.5, momentum=0.9))
HYBRID = "08_hybrid"


def grid(g):
    """08's flag for shard groups of g ranks (R = world size / g replicas)."""
    return ["--shard-group", str(g)]


def step_dir(root, step):
    return os.path.join(root, f"step_{step:06d}")


def copy_checkpoint(src_root, step, dst_root, drop=()):
    """Rank 0 copies one step directory into a new checkpoint root (minus `drop`); all wait."""
    if dist.get_rank() == 0:
        shutil.copytree(step_dir(src_root, step), step_dir(dst_root, step))
        for name in drop:
            os.remove(os.path.join(step_dir(dst_root, step), name))
    dist.barrier()
    return dst_root


def resume(lesson, root, extra=()):
    return run_lesson(lesson, ARGV + ["--checkpoint-dir", root, "--resume", *extra])


def refused(lesson, argv):
    """The message a run refuses with (every rank must refuse: they agree before loading)."""
    try:
        run_lesson(lesson, argv)
    except checkpoint.CheckpointError as e:
        return str(e)
    return "no refusal"


# ----------------------------------------------------------------------------- the toy model
def optimizer_of(lesson, trainer):
    """The torch.optim optimizer whose state the checkpoint holds."""
    return trainer.opt.shard_optimizer.optim if lesson in ("04", "05") else trainer.opt


def toy_steps(trainer, steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, rows = [], BATCH // world
    for step in steps:
        x, y = toy_batch(step)
        loss = torch.tensor(trainer.train_step([(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])]))
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return losses


def toy_resumed(lesson, path, **optimizer):
    """A ToyNet from other weights (its frozen layer too), loaded from `path`, steps 2 and 3."""
    trainer = build(lesson, make_toy(seed=7), **optimizer)
    torch.manual_seed(1234)  # another RNG state: the checkpoint must bring back the saved one
    checkpoint.load(path, *handles(lesson, trainer))
    rng = torch.rand(4)  # what this rank draws next (the lessons draw nothing; other code might)
    return {"losses": toy_steps(trainer, [2, 3]), "params": trainer.full_parameters(), "rng": rng}


def toy_saved(lesson, root, **optimizer):
    """ToyNet (tied, frozen, unused, 119 trainable elements): steps 0-1, save, steps 2-3. optimizer:
    build's optimizer_class and optimizer_kwargs (default AdamW)."""
    trainer = build(lesson, make_toy(seed=0), **optimizer)
    toy_steps(trainer, [0, 1])
    torch.manual_seed(100 + dist.get_rank())  # every rank its own RNG state, saved in its file
    checkpoint.save(step_dir(root, 2), 2, *handles(lesson, trainer), {"strategy": lesson})
    rng = torch.rand(4)
    return {"losses": toy_steps(trainer, [2, 3]), "params": trainer.full_parameters(), "rng": rng}


# ----------------------------------------------------------------------------- refused loads
def snapshot(module, holder, optim):
    """Every tensor a strategy holds (parameters, masters, Adam state), copied."""
    out = [t.detach().clone() for s in reshard.shards(module, holder) for _, t in s.tensors.values()]
    return out + [v.clone() for state in optim.state.values() for v in state.values()]


def untouched_after_refusals(bad, good):
    """ZeRO-1 and ZeRO-3 on the GPT, one step trained: each bad checkpoint is refused and every
    tensor they hold, optimizer state included, is bit for bit what it was. (A good one then
    changes them: the comparison can see a load.)"""
    args = common.parse_args(ARGV)
    env = common.Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "gloo")
    messages = {}
    for lesson in ("04", "06"):
        trainer = build(lesson, common.build_model(args, env), lr=args.lr)
        batch = get_batch(args, env, 0, 0)
        trainer.train_step([batch])
        module, holder = handles(lesson, trainer)
        optim = optimizer_of(lesson, trainer)
        before = snapshot(module, holder, optim)
        for name, path in bad.items():
            try:
                checkpoint.load(path, module, holder)
                messages[lesson, name] = "loaded"
            except checkpoint.CheckpointError as e:
                messages[lesson, name] = str(e)
            after = snapshot(module, holder, optim)
            assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before)), name
        checkpoint.load(good, module, holder)
        after = snapshot(module, holder, optim)
        messages[lesson, "good"] = "loaded" if not all(torch.equal(a, b) for a, b in zip(after, before)) else "same"
    return messages


# ----------------------------------------------------------------------------- the launches
def suite_world2(root):
    out = {"full": {}, "resumed": {}, "refused": {}, "toy": {}, "toy_momentum": {}}
    checkpoint.KEEP = 100  # keep steps 2, 4 and 6: the other launches resume from 2 and 4
    for lesson in LESSONS:
        out["full"][lesson] = run_lesson(lesson, ARGV + SAVE + ["--checkpoint-dir", f"{root}/{lesson}/full"])
        copy_checkpoint(f"{root}/{lesson}/full", 2, f"{root}/{lesson}/w2")
        out["resumed"][lesson] = resume(lesson, f"{root}/{lesson}/w2", SAVE)
    checkpoint.KEEP = 2
    for lesson in SHARDED:  # bf16: parameters bf16, fp32 master shards and moments
        out["full"][lesson, "bf16"] = run_lesson(lesson, ARGV + BF16 + SAVE + ["--checkpoint-dir", f"{root}/{lesson}/bf16"])
        copy_checkpoint(f"{root}/{lesson}/bf16", 4, f"{root}/{lesson}/bf16_w2")
        out["resumed"][lesson, "bf16"] = resume(lesson, f"{root}/{lesson}/bf16_w2", BF16)

    # refusals, all from lesson 04's checkpoint at step 4
    full = f"{root}/04_zero1/full"
    no_marker = copy_checkpoint(full, 4, f"{root}/bad/no_marker", drop=["COMPLETE"])
    truncated = copy_checkpoint(full, 4, f"{root}/bad/truncated")
    missing = copy_checkpoint(full, 4, f"{root}/bad/missing", drop=["rank1.pt"])
    stranger = copy_checkpoint(full, 4, f"{root}/bad/stranger")
    twin = copy_checkpoint(full, 4, f"{root}/bad/twin")
    if dist.get_rank() == 0:
        path = os.path.join(step_dir(truncated, 4), "rank1.pt")
        os.truncate(path, os.path.getsize(path) // 2)
        shutil.copy(os.path.join(step_dir(f"{root}/05_zero2/full", 2), "rank1.pt"), step_dir(stranger, 4))
        # the resumed run's own step 4: same lesson, step and ranges (even the same values), but
        # another save; nothing but the save id tells it apart
        shutil.copy(os.path.join(step_dir(f"{root}/04_zero1/w2", 4), "rank1.pt"), step_dir(twin, 4))
    dist.barrier()
    other = copy_checkpoint(full, 4, f"{root}/bad/other")
    r = out["refused"]
    r["no_marker"] = refused("04_zero1", ARGV + ["--checkpoint-dir", no_marker, "--resume"])
    r["truncated"] = refused("04_zero1", ARGV + ["--checkpoint-dir", truncated, "--resume"])
    r["missing"] = refused("04_zero1", ARGV + ["--checkpoint-dir", missing, "--resume"])
    r["stranger"] = refused("04_zero1", ARGV + ["--checkpoint-dir", stranger, "--resume"])
    r["twin"] = refused("04_zero1", ARGV + ["--checkpoint-dir", twin, "--resume"])
    r["d_model"] = refused("04_zero1", ARGV + ["--d-model", "40", "--checkpoint-dir", other, "--resume"])
    r["precision"] = refused("04_zero1", ARGV + BF16 + ["--checkpoint-dir", other, "--resume"])
    r["done"] = refused("04_zero1", ARGV + ["--steps", "4", "--checkpoint-dir", other, "--resume"])
    r["fresh_run_into_old_dir"] = refused("04_zero1", ARGV + SAVE + ["--checkpoint-dir", other])
    r["fresh_run_into_torn_dir"] = refused("04_zero1", ARGV + SAVE + ["--checkpoint-dir", no_marker])
    r["empty"] = refused("04_zero1", ARGV + ["--checkpoint-dir", f"{root}/bad/empty", "--resume"])

    # a crash while saving step 4: no marker, a torn rank file, a temporary file left behind
    crashed = copy_checkpoint(full, 2, f"{root}/crash")
    copy_checkpoint(full, 4, crashed, drop=["COMPLETE"])
    if dist.get_rank() == 0:
        path = os.path.join(step_dir(crashed, 4), "rank1.pt")
        os.truncate(path, 100)
        with open(path + ".tmp4242", "wb") as f:
            f.write(b"half a file")
    dist.barrier()
    out["crash"] = resume("04_zero1", crashed, SAVE)

    for lesson in TOY_LESSONS:
        out["toy"][lesson] = {"saved": toy_saved(lesson, f"{root}/toy/{lesson}"),
                              "resumed": toy_resumed(lesson, step_dir(f"{root}/toy/{lesson}", 2))}
        out["toy_momentum"][lesson] = {"saved": toy_saved(lesson, f"{root}/toy_momentum/{lesson}", **MOMENTUM),
                                       "resumed": toy_resumed(lesson, step_dir(f"{root}/toy_momentum/{lesson}", 2), **MOMENTUM)}

    # refused by read() (the first four), or after it, by load() comparing shapes (other_model:
    # a sound checkpoint of the toy model): either way before any tensor is touched
    out["untouched"] = untouched_after_refusals({
        "no_marker": step_dir(no_marker, 4), "truncated": step_dir(truncated, 4),
        "missing": step_dir(missing, 4), "stranger": step_dir(stranger, 4), "twin": step_dir(twin, 4),
        "other_model": step_dir(f"{root}/toy/04", 2)}, step_dir(full, 4))
    return out


def suite_resume(root, src, step, tag, lessons, save=False, toy=False, hybrid=None, chunks=False):
    """`lessons` resumed from checkpoint `src` at `step`, at this launch's world size; then
    hybrid(root), 08's runs at this world size, under "08"; chunks: 07's, its blocks one chunk."""
    checkpoint.KEEP = 100
    out = {}
    for lesson in lessons:
        copy_checkpoint(f"{root}/{lesson}/{src}", step, f"{root}/{lesson}/{tag}")
        out[lesson] = resume(lesson, f"{root}/{lesson}/{tag}", SAVE if save else ())
    if toy:
        out["toy"] = {lesson: toy_resumed(lesson, step_dir(f"{root}/toy/{lesson}", 2)) for lesson in TOY_LESSONS}
        out["toy_momentum"] = {lesson: toy_resumed(lesson, step_dir(f"{root}/toy_momentum/{lesson}", 2), **MOMENTUM)
                               for lesson in TOY_LESSONS}
    if hybrid:
        out["08"] = hybrid(root)
    if chunks:  # saved a unit per block, loaded into one chunk of every block (--chunk-mb)
        copy_checkpoint(f"{root}/07_offload/{src}", step, f"{root}/07_offload/{tag}_chunks")
        out["07 chunks"] = resume("07_offload", f"{root}/07_offload/{tag}_chunks", ["--chunk-mb", "1000"])
    return out


def hybrid_2x2(root):
    """World 4, R = 2 x G = 2: 08 uninterrupted (saving at steps 2, 4, 6), resumed at 2 x 2 from
    its own step 2, and resumed at 2 x 2 from 06's world-2 checkpoint at step 2."""
    full = run_lesson(HYBRID, ARGV + grid(2) + SAVE + ["--checkpoint-dir", f"{root}/{HYBRID}/full"])
    return {"full": full,
            "2x2": resume(HYBRID, copy_checkpoint(f"{root}/{HYBRID}/full", 2, f"{root}/{HYBRID}/2x2"), grid(2)),
            "from 06": resume(HYBRID, copy_checkpoint(f"{root}/06_zero3/full", 2, f"{root}/{HYBRID}/from06"), grid(2))}


def hybrid_from_2x2(root, world):
    """08's 2 x 2 checkpoint at step 4, resumed at this world size: as 08 at every G that
    divides it, and (world 2) as 06; and 06's bf16 checkpoint at step 4 as 08 at 1 x 2."""
    src, out = f"{root}/{HYBRID}/full", {}
    for g in range(1, world + 1):  # (1 and 2 divide 2)
        out[f"{world // g}x{g}"] = resume(HYBRID, copy_checkpoint(src, 4, f"{root}/{HYBRID}/{world // g}x{g}"), grid(g))
    if world == 2:
        out["to 06"] = resume("06_zero3", copy_checkpoint(src, 4, f"{root}/06_zero3/from08"))
        bf16 = copy_checkpoint(f"{root}/06_zero3/bf16", 4, f"{root}/{HYBRID}/bf16")
        out["bf16 from 06"] = resume(HYBRID, bf16, BF16 + grid(2))
        out["07 from 08"] = resume("07_offload", copy_checkpoint(src, 4, f"{root}/07_offload/from08"))
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    # brackets, braces and a space: the paths land in meta.json (config) and must survive it
    return str(tmp_path_factory.mktemp("checkpoints") / "run [a] {b}")


@functools.lru_cache(maxsize=None)
def world2(root):
    return spawn(2, suite_world2, root)


# Across world sizes: 01 stands for 01-03 (the same replicated state, optimizers.MixedPrecisionAdamW);
# 3 ranks pad, so the sharded lessons. A launch of 3 or 4 ranks costs ~10 s before any step.
REPLICATED_AND_SHARDED = ["01_vanilla_dp", *SHARDED]


@functools.lru_cache(maxsize=None)
def world4(root):  # from world 2's checkpoint at step 2; saves its own at steps 4 and 6
    world2(root)
    return spawn(4, suite_resume, root, "full", 2, "w4", REPLICATED_AND_SHARDED, True, True, hybrid_2x2)


@functools.lru_cache(maxsize=None)
def world2_from_4(root):
    world4(root)
    return spawn(2, suite_resume, root, "w4", 4, "w4to2", REPLICATED_AND_SHARDED, False, False,
                 functools.partial(hybrid_from_2x2, world=2))


@functools.lru_cache(maxsize=None)
def world1(root):
    world4(root)  # (after world 2's): 08's 2 x 2 checkpoint
    return spawn(1, suite_resume, root, "full", 4, "w1", REPLICATED_AND_SHARDED, False, False,
                 functools.partial(hybrid_from_2x2, world=1))


@functools.lru_cache(maxsize=None)
def world3(root):
    world2(root)
    return spawn(3, suite_resume, root, "full", 2, "w3", SHARDED, False, False, None, True)  # (save, toy, hybrid, chunks)


def tail(run, start):
    """The uninterrupted run from step `start` on: what a run resumed there must give."""
    return {"losses": run["losses"][start:], "params": run["params"]}


# ----------------------------------------------------------------------------- the tests
def test_resume_is_exact_for_every_lesson(root):
    # Same world size: every rank gets back bit for bit the state it had (its shard, fp32
    # masters, Adam moments and step counts) and sums in the same order: identical losses.
    # And the run it is compared with, which saved at steps 2, 4 and 6, trained as a run that
    # never saves: single-process training, within the lessons' fp32 TOL (zero_parity says why).
    ref = reference(ARGV)
    for lesson in LESSONS:
        close(world2(root)[0]["full"][lesson], ref)
    for out in world2(root):
        for lesson in LESSONS:
            full, resumed = out["full"][lesson], out["resumed"][lesson]
            identical(resumed, tail(full, 2))
    report = world2(root)[0]["resumed"]["04_zero1"]["report"]  # rank 0's: the steps run, measured at step 2
    assert report["resumed_from"] == 2 and len(report["losses"]) == 4
    assert report["comm"]["measured_step"] == 2
    # the resumed runs saved step 6 again: the very same state as the uninterrupted run's
    for lesson in LESSONS:
        a = consolidate(step_dir(f"{root}/{lesson}/full", 6))
        b = consolidate(step_dir(f"{root}/{lesson}/w2", 6))
        assert a.keys() == b.keys() and a and all(torch.equal(a[n], b[n]) for n in a), lesson


def test_bf16_resume_is_exact_and_keeps_fp32_masters(root):
    for out in world2(root):
        for lesson in SHARDED:
            identical(out["resumed"][lesson, "bf16"], tail(out["full"][lesson, "bf16"], 4))
    for lesson in SHARDED:
        full = world2(root)[0]["full"][lesson, "bf16"]
        sd = consolidate(step_dir(f"{root}/{lesson}/bf16", 6))
        # the fp32 masters, of which the bf16 weights are the rounding, not the bf16 weights
        assert all(torch.equal(sd[n].bfloat16(), p.bfloat16()) for n, p in full["params"].items())
        if lesson in ("06_zero3", "07_offload"):  # its parameters at rest ARE the fp32 masters (FSDP2's way)
            assert all(torch.equal(sd[n], p) for n, p in full["params"].items())
        else:  # 04, 05: bf16 parameters, fp32 masters beside them
            assert any(not torch.equal(sd[n], p) for n, p in full["params"].items())
        # only the newest two complete checkpoints are kept (checkpoint.KEEP)
        assert sorted(os.listdir(f"{root}/{lesson}/bf16")) == ["step_000004", "step_000006"]


# Another world size sums the same numbers in another order (N per-rank means, the reductions'
# order, clipping's norm summed shard by shard): fp32 round-off, ~1e-7 relative per step, which
# Adam may amplify a little (measured <= 5e-7 on the losses). zero_parity.TOL = 1e-5 is far
# below what a wrong shard (a misplaced range, a stale moment: ~1e-2) would cause; the
# attention key bias, whose exact gradient is zero, is held to KEY_BIAS_ATOL (see zero_parity).
@pytest.mark.parametrize("world, start, launch", [(4, 2, world4), (2, 4, world2_from_4), (1, 4, world1),
                                                  (3, 2, world3)], ids=["2to4", "4to2", "2to1", "2to3"])
def test_resume_at_another_world_size(root, world, start, launch):
    assert (world == 1 or PSI % world) and common.n_params(GPT(common.model_config(common.parse_args(ARGV)))) == PSI
    full = world2(root)[0]["full"]
    for out in launch(root):
        for lesson in (SHARDED if world == 3 else REPLICATED_AND_SHARDED):
            close(out[lesson], tail(full[lesson], start))
            if out[lesson]["report"] is not None:
                assert out[lesson]["report"]["world_size"] == world
                assert out[lesson]["report"]["resumed_from"] == start
        if world == 3:  # 07, its blocks in one chunk: the same parameters, cut in other shards
            close(out["07 chunks"], tail(full["07_offload"], start))


# 08: shard group 0 writes, its replicas write nothing; every rank loads its own shard, at any grid
def test_hybrid_writes_a_06_checkpoint_at_world_g_and_resumes_exactly(root):
    full = world4(root)[0]["08"]["full"]
    # 2 x 2: ranks 0, 1 (shard group 0) write what 06 at world 2 writes; ranks 2, 3, their
    # replicas, write no range (each element once: two copies would be refused as overlapping)
    hybrid, zero3 = (checkpoint.read(step_dir(f"{root}/{lesson}/full", 2))[0] for lesson in (HYBRID, "06_zero3"))
    assert hybrid["layout"][:2] == zero3["layout"] and hybrid["layout"][2:] == [[], []]
    sd = consolidate(step_dir(f"{root}/{HYBRID}/full", 6))  # the whole model, from shard group 0's files
    assert all(torch.equal(sd[n], p) for n, p in full["params"].items())
    for out in world4(root):
        # the same grid: every rank, replicas too, gets back its shard and moments bit for bit
        identical(out["08"]["2x2"], tail(out["08"]["full"], 2))
    # and the uninterrupted run, saving as it goes, trains as one process does (TOL: see above)
    close(full, reference(ARGV))


# Another grid, or 06 (whose files 08's are): another summation order, so TOL (as above)
@pytest.mark.parametrize("launch, run", [(world2_from_4, "1x2"), (world2_from_4, "2x1"), (world1, "1x1"),
                                         (world2_from_4, "to 06")], ids=["2x2to1x2", "2x2to2x1", "2x2to1x1", "2x2to06"])
def test_hybrid_resumes_at_another_grid(root, launch, run):
    full = world4(root)[0]["08"]["full"]
    for out in launch(root):
        close(out["08"][run], tail(full, 4))
        if out["08"][run]["report"] is not None:
            assert out["08"][run]["report"]["resumed_from"] == 4


def test_hybrid_resumes_06s_checkpoints_in_fp32_and_bf16(root):
    zero3 = world2(root)[0]["full"]
    for out in world4(root):  # 06 at world 2 -> 08 at 2 x 2
        close(out["08"]["from 06"], tail(zero3["06_zero3"], 2))
    for out in world2_from_4(root):
        # 06 bf16 at world 2 -> 08 at 1 x 2, which is 06: bit for bit (the shards are fp32 masters)
        identical(out["08"]["bf16 from 06"], tail(zero3["06_zero3", "bf16"], 4))
        # and 07 (as any lesson: test_cross_resume.py) resumes 08's 2 x 2 checkpoint
        close(out["08"]["07 from 08"], tail(world4(root)[0]["08"]["full"], 4))


def test_consolidated_state_dict_is_the_run_and_loads_into_gpt(root):
    full = world2(root)[0]["full"]
    cfg = common.model_config(common.parse_args(ARGV))
    for lesson in LESSONS:
        sd = consolidate(step_dir(f"{root}/{lesson}/full", 6))
        params = full[lesson]["params"]
        assert sd.keys() == params.keys() | {"lm_head.weight"}  # the tied name too
        assert all(torch.equal(sd[n], p) and sd[n].dtype == torch.float32 for n, p in params.items()), lesson
        model = GPT(cfg, seed=None)
        model.load_state_dict(sd)  # strict: no key missing or unexpected, no padding left
        assert model.lm_head.weight is model.wte.weight and torch.equal(model.wte.weight, params["wte.weight"])
    # the world-4 run's checkpoint consolidates to the same model (within TOL: see above)
    sd4 = consolidate(step_dir(f"{root}/06_zero3/w4", 6))
    close({"losses": [], "params": {n: sd4[n] for n in full["06_zero3"]["params"]}},
          {"losses": [], "params": full["06_zero3"]["params"]})


def test_consolidate_command(root, tmp_path):
    world2(root)
    spec = importlib.util.spec_from_file_location("consolidate", os.path.join(ROOT, "scripts", "learn", "consolidate.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = str(tmp_path / "zero3.pt")
    assert script.main([f"{root}/06_zero3/full", out]) == step_dir(f"{root}/06_zero3/full", 6)  # the newest
    sd = torch.load(out, weights_only=True)
    want = consolidate(step_dir(f"{root}/06_zero3/full", 6))
    assert sd.keys() == want.keys() and all(torch.equal(sd[n], want[n]) for n in want)
    GPT(common.model_config(common.parse_args(ARGV)), seed=None).load_state_dict(sd)
    with pytest.raises(SystemExit) as e:  # nowhere to write it: one line, not torch's traceback
        script.main([f"{root}/06_zero3/full", str(tmp_path / "zero3.pt" / "x.pt")])
    assert str(e.value).startswith(f"error: cannot write {tmp_path / 'zero3.pt' / 'x.pt'}: "), e.value


def test_refusals_name_the_problem(root):
    for out in world2(root):  # every rank refuses, with the same message
        r = out["refused"]
        assert "no complete checkpoint in" in r["no_marker"]
        assert "rank1.pt is unreadable (truncated or corrupt)" in r["truncated"]
        assert "rank1.pt is missing (2 ranks saved this checkpoint)" in r["missing"]
        assert "rank1.pt does not belong to this checkpoint" in r["stranger"]
        assert "rank1.pt does not belong to this checkpoint" in r["twin"]
        assert "does not match this run: d_model 35 (checkpoint) != 40 (this run)" in r["d_model"]
        assert "precision fp32 (checkpoint) != bf16 (this run)" in r["precision"]
        assert "at step 4: nothing left to do with --steps 4" in r["done"]
        assert "already holds checkpoints: add --resume to continue from them or" in r["fresh_run_into_old_dir"]
        # only a torn save there: --resume would refuse too, so the message names what works
        assert "holds only incomplete checkpoints (step" in r["fresh_run_into_torn_dir"]
        assert "interrupted saves): delete them or choose another directory" in r["fresh_run_into_torn_dir"]
        assert "no complete checkpoint in" in r["empty"]
    with pytest.raises(checkpoint.CheckpointError, match="has no COMPLETE marker"):
        checkpoint.read(step_dir(f"{root}/bad/no_marker", 4))


def test_refused_load_leaves_every_tensor_untouched(root):
    for out in world2(root):
        for (lesson, name), message in out["untouched"].items():
            # refused, and untouched_after_refusals found every tensor as it was; the good one loads
            assert message == "loaded" if name == "good" else "loaded" not in message, (lesson, name)
        assert "unreadable" in out["untouched"]["06", "truncated"]
        assert "holds other parameters than this model" in out["untouched"]["06", "other_model"]


def test_crash_during_save_resumes_from_the_previous_complete_checkpoint(root):
    full = world2(root)[0]["full"]["04_zero1"]
    for out in world2(root):
        identical(out["crash"], tail(full, 2))  # step 4 had no marker: resumed from step 2
    # and saving step 4 again replaced the torn files with a complete checkpoint
    a = consolidate(step_dir(f"{root}/04_zero1/full", 4))
    b = consolidate(step_dir(f"{root}/crash", 4))
    assert a.keys() == b.keys() and a and all(torch.equal(a[n], b[n]) for n in a)


def test_toy_tied_frozen_and_unused_parameters_round_trip(root):
    # the toy starts from other weights (seed 7, its frozen layer too): only the checkpoint can
    # bring it back, and then bit for bit at the same world size
    for rank, out in enumerate(world2(root)):
        for lesson in TOY_LESSONS:
            identical(out["toy"][lesson]["resumed"], out["toy"][lesson]["saved"])
            # saving drew nothing from the global generator: the draw after it is seed 100 + rank's first
            first = torch.rand(4, generator=torch.Generator().manual_seed(100 + rank))
            assert torch.equal(out["toy"][lesson]["saved"]["rng"], first)
            # each rank's RNG state came back: it draws what it would have drawn had it not stopped
            assert torch.equal(out["toy"][lesson]["resumed"]["rng"], out["toy"][lesson]["saved"]["rng"])
    # at 4 ranks: 119 trainable elements, padded to 120 (within TOL: another summation order)
    for out in world4(root):
        for lesson in TOY_LESSONS:
            close(out["toy"][lesson], world2(root)[0]["toy"][lesson]["saved"])


def test_sgds_momentum_buffers_round_trip_and_reshard(root):
    for out in world2(root):  # the same world size: bit for bit
        for lesson in TOY_LESSONS:
            identical(out["toy_momentum"][lesson]["resumed"], out["toy_momentum"][lesson]["saved"])
    for out in world4(root):  # resharded, padded
        for lesson in TOY_LESSONS:
            close(out["toy_momentum"][lesson], world2(root)[0]["toy_momentum"][lesson]["saved"])
    for lesson in TOY_LESSONS:  # what the files hold: the buffers, no step count
        saved = torch.load(os.path.join(step_dir(f"{root}/toy_momentum/{lesson}", 2), "rank0.pt"), weights_only=False)
        assert {(e["kind"], e["step"]) for e in saved["entries"]} >= {("momentum_buffer", None)}, lesson
        assert all(e["step"] is None for e in saved["entries"]), lesson


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False), (8, True), (10, True), (12, False)):
        os.makedirs(step_dir(tmp_path, step))
        if complete:
            open(os.path.join(step_dir(tmp_path, step), "COMPLETE"), "w").close()
    checkpoint._prune(str(tmp_path))
    # the two newest complete ones, and the save in progress after them; nothing older
    assert sorted(os.listdir(tmp_path)) == ["step_000008", "step_000010", "step_000012"]
    assert checkpoint.latest(str(tmp_path)) == step_dir(tmp_path, 10)


def test_flags_without_a_directory_are_one_line_errors():
    bad = [(["--resume"], "--resume and --save-every need --checkpoint-dir DIR")]  # ~3 s a process
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, lesson_file("04_zero1"), *flags], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for flags, _ in bad]
    for p, (_, message) in zip(procs, bad):
        _, err = p.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip()]
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), err
