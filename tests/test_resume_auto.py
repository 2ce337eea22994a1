"""--resume auto under torchrun's restarts (issue 32): a job that crashes goes on by itself, and
loses nothing.

One torchrun launch of 03 (2 ranks, --max-restarts 2, --save-every 2), crashed twice by
tests/crash.py (SIGKILL, which no handler sees):
- attempt 0 starts fresh (an empty directory) and rank 1 dies after step 3: steps 0-2 run, 2 saved;
- attempt 1 resumes from step 2, and rank 0 dies saving step 4 with all but COMPLETE written;
- attempt 2 resumes from step 2 again (the torn step 4 is no checkpoint) and finishes step 6.
Its losses from step 2 on, and its last checkpoint, are bit for bit an uninterrupted run's (fp32,
the same world size: the same sums in the same order). Then the same command at 1 process
resumes at world size 1 (the elastic case), within fp32 round-off of the 2-rank run.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from lessonkit import checkpoint, common, lifecycle
from graded import lesson_file
from harness import ROOT, run_lesson, spawn
from scripts.learn.consolidate import consolidate
from zero_parity import close

import crash

# tiny and fast (Psi = 15,328): each attempt spends its time starting, not training
ARGV = ["--device", "cpu", "--n-layer", "1", "--d-model", "32", "--n-head", "4", "--vocab-size", "64",
        "--seq-len", "16", "--global-batch", "4", "--peak-params", "0", "--log-every", "1", "--timeout", "30"]
# torch >= 2.5 keeps one store for every attempt; a restarted rank may read the address the last
# attempt's rank 0 left there and fail, or hang (lifecycle.restart_advice): each attempt its own
ENV = dict({k: v for k, v in os.environ.items() if k != "DP_DEBUG"}, OMP_NUM_THREADS="1",
           PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def torchrun(nproc, script, argv):
    """The job script's command: `torchrun --max-restarts 2 ... --resume auto --save-every 2`."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                             "--max-restarts=2", *script, *ARGV, "--resume", "auto", "--save-every", "2", *argv],
                            cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(proc):
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    return out


def step_dir(root, step):
    return os.path.join(root, f"step_{step:06d}")


def uninterrupted(root, empty):
    """In a spawned rank: 8 steps saved every 2, never stopped; and plain --resume on an empty
    directory, which must still refuse."""
    try:
        run_lesson("03_buckets", ARGV + ["--checkpoint-dir", empty, "--resume"])
        refusal = "no refusal"
    except checkpoint.CheckpointError as e:
        refusal = str(e)
    checkpoint.KEEP = 100  # every step's checkpoint, to compare with (in this spawned rank only)
    run = run_lesson("03_buckets", ARGV + ["--steps", "8", "--save-every", "2", "--checkpoint-dir", root])
    return {"losses": run["losses"], "refusal": refusal}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume_auto")
    ckpt, report = str(tmp / "ckpt"), str(tmp / "report.json")
    crashed = torchrun(2, [os.path.join(ROOT, "tests", "crash.py"), "03_buckets"],
                       ["--steps", "6", "--checkpoint-dir", ckpt, "--report", report])
    # a bad value: one line, before anything starts (meanwhile, torchrun waits on its workers)
    bad = subprocess.Popen([sys.executable, lesson_file("03_buckets"), "--resume", "bogus"], cwd=ROOT, env=ENV,
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ref = spawn(2, uninterrupted, str(tmp / "ref"), str(tmp / "empty"))[0]
    out = {"ref": ref, "ref_dir": str(tmp / "ref"), "ckpt": ckpt, "log": finished(crashed),
           "report": json.load(open(report)), "bad": (bad.communicate(timeout=120)[1], bad.returncode)}
    out["step4"] = (os.listdir(step_dir(ckpt, 4)), consolidate(step_dir(ckpt, 4)))  # pruned by the next save
    # the elastic case: the same command, 1 process, two more steps
    report1 = str(tmp / "report1.json")
    out["log1"] = finished(torchrun(1, [lesson_file("03_buckets")],
                                    ["--steps", "8", "--checkpoint-dir", ckpt, "--report", report1]))
    out["report1"] = json.load(open(report1))
    # and once more, the job already finished (a restart after its last save): nothing to do, exit 0
    again = subprocess.run([sys.executable, lesson_file("03_buckets"), *ARGV, "--resume", "auto", "--save-every", "2",
                            "--steps", "8", "--checkpoint-dir", ckpt], cwd=ROOT, env=ENV, text=True, capture_output=True,
                           timeout=120)
    out["again"] = (again.returncode, again.stdout, again.stderr)
    return out


def test_crashed_run_finishes_with_the_uninterrupted_losses(runs):
    ckpt, log = runs["ckpt"], runs["log"].splitlines()
    # attempt 0 found nothing and said so; attempts 1 and 2 both resumed from step 2
    assert log.count(f"--resume auto: no complete checkpoint in {ckpt}: starting at step 0") == 1, runs["log"]
    resumed = [i for i, line in enumerate(log) if line.startswith("resumed from")]
    assert [log[i] for i in resumed] == [f"resumed from {step_dir(ckpt, 2)}: step 2, saved at world size 2, now 2"] * 2
    steps = [[line.split()[1] for line in part if line.startswith("step ")]  # rank 0's log, attempt by attempt
             for part in (log[:resumed[0]], log[resumed[0]:resumed[1]], log[resumed[1]:])]
    assert steps == [["0/6", "1/6", "2/6"], ["2/6", "3/6"], ["2/6", "3/6", "4/6", "5/6"]], runs["log"]
    # bit for bit, from the resumed step on: losses, and the state saved at the end
    report = runs["report"]
    assert report["resumed_from"] == 2 and report["world_size"] == 2
    assert report["losses"] == runs["ref"]["losses"][2:6]
    a, b = consolidate(step_dir(ckpt, 6)), consolidate(step_dir(runs["ref_dir"], 6))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_killed_during_a_save_the_previous_checkpoint_is_used(runs):
    # attempt 1 died writing step 4's COMPLETE: attempt 2, the last, resumed from step 2, and its
    # own save of step 4 replaced the torn one
    assert crash.SAVE_KILLED == 4 and crash.KILL_AFTER == 3
    last = [line for line in runs["log"].splitlines() if line.startswith("resumed from")][-1]
    assert last.startswith(f"resumed from {step_dir(runs['ckpt'], 2)}: step 2"), runs["log"]
    files, a = runs["step4"]
    assert sorted(files) == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp", "meta.json", "rank0.pt", "rank1.pt"]
    b = consolidate(step_dir(runs["ref_dir"], 4))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_resumes_at_a_smaller_world_size(runs):
    # 2 ranks' checkpoint at step 6, 1 process on: another summation order, so fp32 round-off
    # (zero_parity.close, as test_checkpoint's test_resume_at_another_world_size, which says why)
    ckpt = runs["ckpt"]
    assert f"resumed from {step_dir(ckpt, 6)}: step 6, saved at world size 2, now 1" in runs["log1"].splitlines()
    report = runs["report1"]
    assert report["world_size"] == 1 and report["resumed_from"] == 6
    close({"losses": report["losses"], "params": consolidate(step_dir(ckpt, 8))},
          {"losses": runs["ref"]["losses"][6:8], "params": consolidate(step_dir(runs["ref_dir"], 8))})


def test_a_finished_job_restarted_has_nothing_to_do_and_exits_0(runs):
    # (plain --resume still refuses it: test_checkpoint's test_refusals_name_the_problem)
    code, out, err = runs["again"]
    assert code == 0, err
    assert f"--resume auto: {step_dir(runs['ckpt'], 8)} is at step 8, --steps 8: the run has finished, nothing " \
           "left to do" in out.splitlines(), out
    assert not any(line.startswith("step ") for line in out.splitlines()), out


def test_plain_resume_still_needs_a_checkpoint(runs):
    assert "--resume: no complete checkpoint in" in runs["ref"]["refusal"]


def test_resume_flag(runs, monkeypatch, tmp_path):
    def parse(*flags):
        return common.parse_args([*flags, "--checkpoint-dir", str(tmp_path), "--save-every", "1"]).resume
    assert (parse(), parse("--resume"), parse("--resume", "auto")) == (False, True, "auto")
    assert parse("--resume", "--steps", "3") is True  # a flag after it is no value of it

    def fail(message, code=2):  # what lifecycle.fail would print, then exit with
        raise SystemExit(message)
    monkeypatch.setattr(common, "fail", fail)
    with pytest.raises(SystemExit, match="--resume and --save-every need --checkpoint-dir DIR"):
        common.parse_args(["--resume", "auto"])
    # and end to end: one line, exit 2
    err, code = runs["bad"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: argument --resume: invalid choice: 'bogus'"), err


def test_restart_advice(monkeypatch):
    # under torchrun --max-restarts with its shared store (torch's default), rank 0 says what to set
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lifecycle.restart_advice()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # what the variable gives
    assert lifecycle.restart_advice() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    assert lifecycle.restart_advice() is None
