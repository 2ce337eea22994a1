"""A lesson's process under torchrun: a clean exit, one line per failure, a lost rank named.

run_main(main) turns an expected failure (a bad flag, a lost peer, a timeout) into one line per
rank and a non-zero exit, never a traceback or a hang; exit_process() leaves without the
interpreter teardown that sometimes aborts gloo; the heartbeat names the peer that is gone;
restart_advice() warns of a torchrun set-up whose restarts may fail (docs/checkpoints.md).
"""
import math
import os
import signal
import sys
import threading
import time

import torch.distributed as dist


# ----------------------------------------------------------------------------- one line, then exit
def say(line):
    """One line to stderr in one write: ranks share torchrun's stderr, and print() may split a
    line from its newline, gluing two ranks' lines together."""
    sys.stderr.flush()
    os.write(2, (line + "\n").encode())


def fail(message, code=2):
    """A clear one-line error from rank 0 and a non-zero exit from every rank."""
    rank, world = (os.environ.get(n, d) for n, d in (("RANK", "0"), ("WORLD_SIZE", "1")))
    if not (rank.isdecimal() and world.isdecimal()) or not 0 < int(rank) < int(world):  # rank 0, or one env_int refuses
        say(f"error: {message}")
    else:  # let rank 0 speak first: torchrun stops the other ranks as soon as one exits, and
        # then this rank has nothing to add (rank 0 said what was wrong)
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(code))
        time.sleep(2)
    exit_process(code)


def env_int(name, default):
    """torchrun's RANK, WORLD_SIZE, LOCAL_RANK or LOCAL_WORLD_SIZE as a number, `default` where unset.
    Garbled (a shell's leftover, a typo) it once ended in int()'s "invalid literal for int()"."""
    value = os.environ.get(name, str(default))
    if not value.isdecimal() or int(value) < (name == "WORLD_SIZE"):
        fail(f"{name}={value!r} in the environment is not a {'count of ranks' if 'SIZE' in name else 'rank'}: "
             "torchrun sets it (unset it to run one process)")
    return int(value)


def launched_world():
    """torchrun's WORLD_SIZE, 1 for plain `python`; its four variables checked first. One WORLD_SIZE left
    in a shell, without RANK, once went unnoticed: the process trained alone, checked against another world."""
    world, rank, _, _ = (env_int(n, d) for n, d in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)))
    if world > 1 and "RANK" not in os.environ:
        fail(f"WORLD_SIZE={world} but no RANK: start the ranks with torchrun --nproc_per_node={world}, or unset WORLD_SIZE")
    if rank >= world:
        fail(f"RANK={rank} in the environment is not below WORLD_SIZE={world}: torchrun sets both (unset them to run one process)")
    return world


def restart_advice():
    """A line for a job torchrun may restart (--max-restarts) in the store it shares with its
    workers (torch's default since 2.5), else None. That store outlives every attempt, with the
    addresses the last attempt's ranks left in it: a restarted rank may read one before rank 0
    rewrites it, then fail to connect or hang (gloo, torch 2.13: about half the restarts; NCCL:
    pytorch/pytorch#135712). With the variable set, each attempt gets a new store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        return ("warning: torchrun --max-restarts with its shared store: a restart may read the last attempt's "
                "addresses and fail or hang (pytorch/pytorch#135712); run torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    return None


# ----------------------------------------------------------------------------- the heartbeat
# A dead peer shows up as "Connection closed by peer [address]" from the collective that needed
# it: an address, not a rank, and on a ring every rank behind it fails the same way. To name the
# lost rank, every rank bumps a counter in the rendezvous store (torchrun's agent, or rank 0)
# once a second from a daemon thread; after a failure, a counter that stopped moving is a rank
# that is gone. A rank that is alive but stuck in a collective keeps beating.
# On NCCL no Python exception comes: a collective waiting for a dead peer blocks the main
# thread in CUDA (where no signal handler runs either) until NCCL's own watchdog aborts the
# process at --timeout, with no word on who was lost. So there the heartbeat thread also
# watches the others' counters and, once one has stood still for WATCHDOG_S, names it and ends
# this rank itself (DP_WATCHDOG=1 turns the watch on for gloo too: the tests use it).
HEARTBEAT_S = 1.0
WATCHDOG_S = 10.0
TEARDOWN_S = 5.0  # the most a clean exit waits for NCCL's teardown (gloo's: none, exit_process)
_heartbeat = None
# One line per rank: the first thread to see the failure takes this lock and reports it; a later
# one (a SIGTERM during the report included) leaves the exit to it.
_failure = threading.Lock()
# Where the heartbeat beats: the launch's store, world size and this rank (they stay when
# scripts/perf/sweep.py re-forms the default group over fewer ranks, with a store of its own).
_store = _world = _rank = None


def start_heartbeat(rank, watch=False, after_s=WATCHDOG_S):
    global _heartbeat, _store, _world, _rank
    if _heartbeat is not None and _heartbeat.is_alive():  # main() run again in one process (tests)
        return
    _store, _world, _rank = dist.distributed_c10d._get_default_store(), dist.get_world_size(), rank
    moved = {}

    def beat():
        while True:
            try:
                _store.add(f"heartbeat/{rank}", 1)
                lost = _stopped_beating(moved, after_s) if watch else []
            except Exception:  # the store is gone: the failure path reports it
                return
            if lost and _failure.acquire(blocking=False):
                say(f"error (rank {rank}): {_named(lost, after_s)}; this rank stops too")
                _leave(1)
            time.sleep(HEARTBEAT_S)

    _heartbeat = threading.Thread(target=beat, name="heartbeat", daemon=True)
    _heartbeat.start()


def _stopped_beating(moved, for_s):
    """The other ranks whose heartbeat counter has stood still for for_s seconds, by `moved`
    (rank -> (counter, when it last moved), updated here), less those whose silence is no
    failure: done/ (left on purpose) and stopping/ (stopped by the launcher, as this rank may be)."""
    now = time.monotonic()
    for r in range(_world):
        count = _store.add(f"heartbeat/{r}", 0)  # add 0: read a counter without blocking
        if r not in moved or moved[r][0] != count:
            moved[r] = (count, now)
    return [r for r, (_, t) in moved.items() if r != _rank and now - t >= for_s
            and not _store.check([f"stopping/{r}"]) and not _store.check([f"done/{r}"])]


def lost_ranks(stopping=False):
    """After a failure, the ranks whose heartbeat stood still for three beats; None if the store
    itself is unreachable (then the rank or launcher that hosted it, rank 0's node, is the one
    lost). stopping: this rank was told to stop (SIGTERM) and says so first, so that peers
    stopped with it are not reported as lost when its heartbeat ends."""
    try:
        if stopping:
            _store.set(f"stopping/{_rank}", "")
        moved = {}
        _stopped_beating(moved, 3 * HEARTBEAT_S)  # the first reading
        time.sleep(3 * HEARTBEAT_S)
        return _stopped_beating(moved, 3 * HEARTBEAT_S)
    except Exception:
        return None


def _named(lost, seconds):
    return f"lost rank {', '.join(map(str, lost))} (no heartbeat for {seconds:.0f} s)"


def exit_process(code=0):
    """Leave without interpreter teardown: on CPU with gloo about 4% of runs abort in it ("terminate
    called without an active exception") after training finished; os._exit after flushing does not.
    After a failure the group is not destroyed (that waits for peers, and one may be dead)."""
    if dist.is_initialized() and code == 0:
        try:
            if _store is not None:  # the others watch this rank's heartbeat
                leaving_on_purpose(_store, _rank)
            # NCCL's communicators, destroyed (bounded); gloo's sockets close with the process.
            # (torch 2.6's gloo teardown can block for good holding the GIL once a peer has left,
            # so that not even a thread's timeout returns: 07 at 2 ranks, 4 runs in 15 here.)
            if dist.get_backend() == "nccl":
                teardown = threading.Thread(target=_destroy_quietly, daemon=True)
                teardown.start()
                teardown.join(TEARDOWN_S)
        except Exception:  # a peer already gone: nothing left to tear down politely
            pass
    _leave(code)


def _destroy_quietly():
    try:
        dist.destroy_process_group()
    except Exception:  # a peer already gone: nothing left to tear down politely
        pass


def leaving_on_purpose(store, rank):
    """Tell the others' heartbeat watch that this rank's silence from now on is no failure."""
    store.set(f"done/{rank}", "")


def _leave(code):
    """Flush and end the process now, from any thread. On NCCL the communicators are aborted
    first, so no GPU kernel keeps waiting for a peer (a daemon thread: if even the abort hangs,
    the process still ends after 5 s)."""
    if code != 0 and dist.is_initialized() and dist.get_backend() == "nccl":
        aborting = threading.Thread(target=dist.distributed_c10d._abort_process_group, daemon=True)
        aborting.start()
        aborting.join(5.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main):
    """Run a lesson's main(): a clean one-line error for expected failures, then a clean exit."""
    def stopped(signum, frame):  # torchrun stops the other ranks with SIGTERM when one fails
        if not _failure.acquire(blocking=False):  # this rank is already naming the lost peer;
            return  # it exits when done (torchrun waits 30 s before it sends SIGKILL)
        # The heartbeats live in torchrun's store, which outlives its workers: name who is gone.
        lost = lost_ranks(stopping=True) if _store is not None else None
        why = (_named(lost, 3 * HEARTBEAT_S) if lost
               else "every rank is still beating, so the stop came from outside the job" if lost == []
               else "most likely because another rank failed")
        say(f"error (rank {os.environ.get('RANK', '0')}): stopped by the launcher (SIGTERM): {why}; "
            "see the launcher's report")
        _leave(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    try:
        diverged = _diverged(main())
    except KeyboardInterrupt:
        exit_process(130)
    except Exception as e:  # e.g. a peer lost, a timeout: one line per rank, not a traceback
        if os.environ.get("DP_DEBUG"):
            raise
        if not _failure.acquire(blocking=False):  # the heartbeat thread is already reporting
            threading.Event().wait()               # (and ending) this rank
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        collective = isinstance(e, RuntimeError) and not isinstance(e, NotImplementedError)
        if collective and _store is not None:
            lost = lost_ranks()  # a failed collective: say which peer is gone, if one is
            if lost is None:
                first = f"lost rank 0 (its rendezvous store is unreachable); {first}"
            elif lost:
                first = f"{_named(lost, 3 * HEARTBEAT_S)}; {first}"
        if "Muon only supports 2D" in first:  # torch.optim.Muon over 06-08's shards: torch's check, our reason
            first += ": a flat shard holds pieces of matrices; 09_muon.py (--zero3 1: 06's units) gives each rank whole ones"
        say(f"error (rank {os.environ.get('RANK', '0')}): {type(e).__name__}: {first} (DP_DEBUG=1 shows the traceback)")
        exit_process(1)
    if diverged:  # a finished run whose loss is nan or infinite: not a result (every rank holds the same losses)
        fail(diverged, code=1)
    exit_process(0)


def _diverged(run):
    """Where a lesson's run (what its main() returns) ends on losses that are not finite, in a line."""
    losses = [] if getattr(getattr(run, "env", None), "simulated", False) else getattr(run, "losses", None) or []
    if not losses or math.isfinite(losses[-1]):  # (an fp16 step whose loss overflowed, then recovered: trained)
        return None
    at = len(losses)
    while at and not math.isfinite(losses[at - 1]):  # back to where the losses stopped being finite
        at -= 1
    step = (getattr(run, "resumed_from", None) or 0) + at
    return (f"the loss is {losses[at]} from step {step} on: training diverged "
            "(the summary above); a smaller --lr, --warmup-steps or --grad-clip may help")
