"""A rank that dies (or freezes) mid-step: every other rank exits non-zero, within the timeout, naming it.

Two ways to launch. Plain processes joined through MASTER_ADDR/MASTER_PORT: rank 0 then hosts
the rendezvous store, so killing rank 0 also tests the "store unreachable" path. And torchrun,
which notices the dead worker itself and stops the survivor with SIGTERM, possibly before the
survivor's next collective fails: the survivor must name the lost rank either way.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from graded import lesson_file
from harness import ROOT

TIMEOUT_S = 30  # --timeout: the survivors must be out well before a hung collective would be


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FLAGS = ["--device", "cpu", "--steps", "100000", "--log-every", "1", "--peak-params", "0", "--n-layer", "2",
         "--d-model", "32", "--seq-len", "16", "--timeout", str(TIMEOUT_S)]
ENV = {k: v for k, v in os.environ.items() if k != "DP_DEBUG"} | dict(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def start_pair(**extra_env):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(ENV, **extra_env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, lesson_file("01_vanilla_dp"), *FLAGS],
                                      cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def wait_for_step(proc, step=3):
    for line in proc.stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= step:
            return


def worker(torchrun_pid, rank):
    """The pid of torchrun's worker process for `rank` (its children, told apart by RANK)."""
    with open(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children") as f:
        for pid in f.read().split():
            with open(f"/proc/{pid}/environ", "rb") as env:
                if f"RANK={rank}".encode() in env.read().split(b"\0"):
                    return int(pid)
    raise AssertionError(f"no worker for rank {rank} under torchrun {torchrun_pid}")


def kill_mid_training(procs, victim, result):
    """Wait until rank 0 has logged three steps, SIGKILL `victim`, time the survivor's exit."""
    wait_for_step(procs[0])
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = procs[1 - victim]
    code = survivor.wait(TIMEOUT_S + 30)
    result[victim] = (code, time.monotonic() - killed, survivor.stderr.read())
    for p in procs:
        p.kill()
        p.wait()


def kill_under_torchrun(result):
    """torchrun with 2 ranks: SIGKILL rank 1's worker mid-training; rank 0 must still name it."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             lesson_file("01_vanilla_dp"), *FLAGS],
                            cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_step(proc)
        os.kill(worker(proc.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        code = proc.wait(TIMEOUT_S + 30)
        result["torchrun"] = (code, time.monotonic() - killed, proc.stderr.read())
    finally:
        proc.kill()
        proc.wait()


def freeze_mid_training(result):
    """With the heartbeat watch on (NCCL's default; DP_WATCHDOG=1 here on gloo): SIGSTOP rank 1,
    alive but silent, as a hung GPU or node looks. No collective raises before --timeout; the
    watch must end rank 0 after WATCHDOG_S, naming rank 1."""
    procs = start_pair(DP_WATCHDOG="1")
    try:
        wait_for_step(procs[0])
        procs[1].send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        code = procs[0].wait(TIMEOUT_S + 30)
        result["frozen"] = (code, time.monotonic() - frozen, procs[0].stderr.read())
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_killed_rank_is_named_by_the_survivor():
    pairs = {1: start_pair(), 0: start_pair()}  # kill rank 1 in one run, rank 0 in the other
    result = {}
    threads = [threading.Thread(target=kill_mid_training, args=(procs, victim, result))
               for victim, procs in pairs.items()]
    threads.append(threading.Thread(target=kill_under_torchrun, args=(result,)))
    threads.append(threading.Thread(target=freeze_mid_training, args=(result,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    code, seconds, err = result.pop("frozen")
    ours = [l for l in err.splitlines() if l.startswith("error (rank")]
    # 10 s without a heartbeat (lifecycle.WATCHDOG_S), well before the 30 s gloo would wait
    assert code == 1 and seconds < TIMEOUT_S * 0.75, (code, seconds, err)
    assert ours == ["error (rank 0): lost rank 1 (no heartbeat for 10 s); this rank stops too"], err
    code, seconds, err = result.pop("torchrun")
    # rank 0 names rank 1 whichever comes first: its failed collective, or torchrun's SIGTERM
    # ("stopped by the launcher (SIGTERM): lost rank 1 ..."); torchrun's own report follows
    ours = [l for l in err.splitlines() if l.startswith("error (rank")]
    assert code != 0 and seconds < TIMEOUT_S, (code, seconds, err)
    assert len(ours) == 1 and ours[0].startswith("error (rank 0): ") and "lost rank 1 " in ours[0], err
    for victim, (code, seconds, err) in result.items():
        ours = [l for l in err.splitlines() if l.startswith("error (rank")]
        assert code == 1, err
        assert seconds < TIMEOUT_S, f"survivor took {seconds:.1f} s to give up"
        # one line of ours from the survivor, naming the lost rank (gloo's message names only
        # an address, and with rank 0 gone c10d logs a warning about its store before it)
        assert len(ours) == 1 and f"lost rank {victim} " in ours[0], err
        assert ours[0].startswith(f"error (rank {1 - victim}): RuntimeError"), err
        assert "Traceback" not in err


@pytest.mark.parametrize("backend, teardown", [("gloo", "os._exit(3)"), ("nccl", "threading.Event().wait()"),
                                               ("nccl", "1 / 0")])
def test_a_teardown_that_never_returns_does_not_hold_a_finished_run(backend, teardown):
    # torch 2.6's gloo destroy_process_group sometimes never returned once the peer had left (07
    # and 08 at 2 ranks), holding the GIL, so that not even a thread's timeout got back: on gloo
    # a finished run does not call it (os._exit(3) here would show it did). NCCL's communicators
    # are destroyed, bounded by lifecycle.TEARDOWN_S; one whose teardown raises (a peer gone)
    # must say nothing of it
    script = ("import os, threading, torch.distributed as dist\n"
              "from lessonkit import lifecycle\n"
              f"dist.init_process_group('gloo', rank=0, world_size=1, init_method='tcp://127.0.0.1:{free_port()}')\n"
              f"dist.get_backend = lambda *group: {backend!r}\n"
              f"dist.destroy_process_group = lambda: {teardown}  # as on torch 2.6\n"
              "print('trained', flush=True)\n"
              "lifecycle.exit_process(0)\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, text=True, capture_output=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "trained\n" and "Traceback" not in out.stderr, out
    assert time.monotonic() - start < 30, "the exit waited for the teardown"
