"""A plain PyTorch state_dict in and out: --init-from FILE starts any lesson from a GPT's weights
(lessonkit/pretrained.py), and scripts/learn/consolidate.py writes a run's weights as one (its
own tests: test_checkpoint.py). The file here: 05's weights after 3 steps, so no seed gives them."""
import os

import torch
import torch.distributed as dist

from harness import reference, run_lesson, spawn
from lessonkit import common
from model import GPT
from scripts.learn.consolidate import consolidate
from test_checkpoint import ARGV, refused, step_dir
from test_cross_resume import LESSONS, SEPARATE_MASTERS
from zero_parity import close

ARGV = [*ARGV[:1], "3", *ARGV[2:]]  # 3 steps from the file's weights
BF16 = ["--precision", "bf16"]


def runs(root):
    """World 2: the file, then every lesson from it (trained; and one step at --lr 0, which moves no
    weight: what it started from), bf16 too, and the files it refuses."""
    run_lesson("05_zero2", ARGV + ["--save-every", "3", "--checkpoint-dir", f"{root}/trained"])
    weights, not_a_state_dict = f"{root}/weights.pt", f"{root}/list.pt"
    if dist.get_rank() == 0:
        torch.save(consolidate(step_dir(f"{root}/trained", 3)), weights)
        torch.save([1, 2, 3], not_a_state_dict)
    dist.barrier()
    init, out = ["--init-from", weights], {"refused": {}}
    for lesson in LESSONS:
        out[lesson] = run_lesson(lesson, ARGV + init)
        for prec, extra in (("fp32", []), ("bf16", BF16)):
            out[lesson, prec] = run_lesson(lesson, ARGV + extra + init + ["--steps", "1", "--lr", "0"])["params"]
    for name, argv in {"missing": ["--init-from", f"{root}/none.pt"], "folder": ["--init-from", root],
                       "not_a_state_dict": ["--init-from", not_a_state_dict],
                       "other_model": init + ["--d-model", "40"]}.items():
        out["refused"][name] = {lesson: refused(lesson, ARGV + argv) for lesson in ("04_zero1", "06_zero3")}
    return out


def test_every_lesson_starts_from_the_file_and_trains_as_one_process_from_it(tmp_path):
    root = str(tmp_path)
    results = spawn(2, runs, root)
    weights = torch.load(os.path.join(root, "weights.pt"), weights_only=True)
    seeded = GPT(common.model_config(common.parse_args(ARGV)), seed=0)
    assert not torch.equal(weights["wte.weight"], seeded.wte.weight)  # not what a seed gives
    ref = reference(ARGV + ["--init-from", os.path.join(root, "weights.pt")])
    for out in results:
        for lesson in LESSONS:
            for prec in ("fp32", "bf16"):
                # bf16: 01-05 show their bf16 parameters, the file's values rounded; 06-08 their fp32 shards
                rounded = prec == "bf16" and lesson in SEPARATE_MASTERS
                want = {n: w.bfloat16().float() if rounded else w for n, w in weights.items() if n != "lm_head.weight"}
                got = out[lesson, prec]
                assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want), (lesson, prec)
            close(out[lesson], ref)
        for lesson, message in out["refused"]["missing"].items():
            assert message.startswith(f"--init-from {root}/none.pt: cannot read it: "), (lesson, message)
        for lesson, message in out["refused"]["folder"].items():
            assert message.startswith(f"--init-from {root}: cannot read it: "), (lesson, message)
        for lesson, message in out["refused"]["not_a_state_dict"].items():
            assert message == f"--init-from {root}/list.pt: not a state_dict ({{name: tensor}})", (lesson, message)
        for lesson, message in out["refused"]["other_model"].items():
            assert "not this model's weights (check the model flags): wte.weight is [65, 35], this model's [65, 40]" \
                in message, (lesson, message)
