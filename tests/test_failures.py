"""A rank that dies mid-step: every other rank exits non-zero, within the timeout, naming it.

The ranks are plain processes joined through MASTER_ADDR/MASTER_PORT (no torchrun: torchrun
would stop the survivors itself with SIGTERM and print its own report, which hides ours). Rank 0
then hosts the rendezvous store, so killing rank 0 also tests the "store unreachable" path.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from harness import ROOT, lesson_file

TIMEOUT_S = 30  # --timeout: the survivors must be out well before a hung collective would be


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pair():
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.pop("DP_DEBUG", None)
        procs.append(subprocess.Popen(
            [sys.executable, lesson_file("01_vanilla_dp"), "--steps", "100000", "--log-every", "1",
             "--peak-params", "0", "--n-layer", "2", "--d-model", "32", "--seq-len", "16",
             "--timeout", str(TIMEOUT_S)],
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return procs


def kill_mid_training(procs, victim, result):
    """Wait until rank 0 has logged three steps, SIGKILL `victim`, time the survivor's exit."""
    for line in procs[0].stdout:
        if line.startswith("step") and int(line.split()[1].split("/")[0]) >= 3:
            break
    procs[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = procs[1 - victim]
    code = survivor.wait(TIMEOUT_S + 30)
    result[victim] = (code, time.monotonic() - killed, survivor.stderr.read())
    for p in procs:
        p.kill()
        p.wait()


def test_killed_rank_is_named_by_the_survivor():
    pairs = {1: start_pair(), 0: start_pair()}  # kill rank 1 in one run, rank 0 in the other
    result = {}
    threads = [threading.Thread(target=kill_mid_training, args=(procs, victim, result))
               for victim, procs in pairs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for victim, (code, seconds, err) in result.items():
        ours = [l for l in err.splitlines() if l.startswith("error (rank")]
        assert code == 1, err
        assert seconds < TIMEOUT_S, f"survivor took {seconds:.1f} s to give up"
        # one line of ours from the survivor, naming the lost rank (gloo's message names only
        # an address, and with rank 0 gone c10d logs a warning about its store before it)
        assert len(ours) == 1 and f"lost rank {victim} " in ours[0], err
        assert ours[0].startswith(f"error (rank {1 - victim}): RuntimeError"), err
        assert "Traceback" not in err
