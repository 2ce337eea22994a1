"""PyTorch's DCP both ways (lessonkit/dcp.py). Every lesson's checkpoint is a DCP checkpoint too:
torch's dcp_to_torch_save reads it, the whole model (which model.GPT loads) and the optimizer's
state, equal to the lessons' own files. FSDP2 + AdamW on the same GPT, saved with get_state_dict
and dcp.save, resumes in the lessons at another world size and continues to FSDP2's own losses;
and FSDP2 loads the lessons' checkpoints and continues to their losses. (Another arithmetic, or
another world size: fp32 round-off, zero_parity.close's TOL.)"""
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import test_cross_resume as writers
from harness import run_lesson, spawn
from lessonkit import common
from lessons import build
from model import GPT, get_batch
from test_checkpoint import step_dir
from zero_parity import close

ARGV = writers.ARGV  # 3 steps; the lessons' checkpoints at step 2 (test_cross_resume's writers)


def fsdp2(argv, root, save_at=None, load=None):
    """In a spawned rank: FSDP2 (tests/lessons.py) on the GPT of `argv`, saving its state with
    get_state_dict and dcp.save after step `save_at` into root/step_N, or starting from the DCP
    checkpoint `load` (dcp.load into get_state_dict's structure, then set_state_dict) at its step."""
    args = common.parse_args(argv)
    env = common.Dist(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), "gloo")
    trainer = build("fsdp2", common.build_model(args, env), grad_clip=args.grad_clip, lr=args.lr,
                    weight_decay=args.weight_decay)
    start = 0
    if load:
        model, optim = get_state_dict(trainer.model, trainer.opt)
        sd = {"model": model, "optim": optim}  # (param_groups: FSDP2's own, the flags': not in the lessons' files)
        dcp.load(sd, checkpoint_id=load, planner=DefaultLoadPlanner(allow_partial_load=True))
        set_state_dict(trainer.model, trainer.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = int(os.path.basename(load)[len("step_"):])
    losses = []
    for step in range(start, args.steps):
        loss = torch.tensor(trainer.train_step([get_batch(args, env, step, 0)]))
        dist.all_reduce(loss)
        losses.append(loss.item() / env.world_size)
        if step + 1 == save_at:
            model, optim = get_state_dict(trainer.model, trainer.opt)
            dcp.save({"model": model, "optim": optim}, checkpoint_id=step_dir(root, save_at))
    return {"losses": losses, "params": trainer.full_parameters()}


def lessons_from_fsdp2(root):
    """At this launch's world size: every lesson resumed from FSDP2's DCP checkpoint at step 2."""
    return {lesson: run_lesson(lesson, ARGV + ["--checkpoint-dir", root, "--resume"]) for lesson in writers.LESSONS}


def fsdp2_from_lessons(root):
    return {lesson: fsdp2(ARGV, root, load=step_dir(writers.directory(root, "fp32", lesson), 2))
            for lesson in writers.LESSONS}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dcp"))


@functools.lru_cache(maxsize=None)
def from_fsdp2(root):
    full = spawn(2, fsdp2, ARGV, f"{root}/fsdp2", 2)[0]
    return full, spawn(3, lessons_from_fsdp2, f"{root}/fsdp2")


def test_torchs_dcp_to_torch_save_reads_every_lessons_checkpoint(root, tmp_path):
    for (lesson, prec), state in writers.written(root).items():
        path = tmp_path / f"{lesson}_{prec}.pt"
        dcp_to_torch_save(step_dir(writers.directory(root, prec, lesson), 2), path)
        sd = torch.load(path, weights_only=False)
        GPT(common.model_config(common.parse_args(ARGV))).load_state_dict(sd["model"])  # strict: every name, tied too
        for (name, what), t in state.items():  # the trained values (fp32 masters), moments, step: equal
            got = sd["model"][name] if what == "weights" else sd["optim"]["state"][name][what]
            assert torch.equal(got.float(), t), (lesson, prec, name, what)


def test_fsdp2s_dcp_checkpoint_resumes_in_every_lesson_at_another_world_size(root):
    full, resumed = from_fsdp2(root)
    for out in resumed:
        for lesson in writers.LESSONS:
            close(out[lesson], {"losses": full["losses"][2:], "params": full["params"]})
            if out[lesson]["report"] is not None:
                assert out[lesson]["report"]["resumed_from"] == 2


def test_fsdp2_loads_every_lessons_checkpoint_and_continues_to_its_losses(root):
    writers.written(root)
    own = spawn(2, writers.read, root, [(lesson, lesson, "fp32") for lesson in writers.LESSONS], 2)[0]
    for out in spawn(2, fsdp2_from_lessons, root):
        for lesson in writers.LESSONS:
            close(out[lesson], own[lesson, lesson, "fp32"])
