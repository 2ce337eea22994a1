"""Run a lesson as torchrun's worker and crash it on purpose (tests/test_resume_auto.py), so that the
lessons and lessonkit hold no fault injection:

    python -m torch.distributed.run --max-restarts 2 ... tests/crash.py 03_buckets --resume auto ...

torchrun's attempt (TORCHELASTIC_RESTART_COUNT) picks the crash, by SIGKILL, which no handler sees:
- attempt 0: the last rank (rank 1 at world 2; rank 0 at world 1, as on one GPU) dies after
  KILL_AFTER optimizer steps, between two saves (--save-every 2);
- attempt 1: rank 0 dies saving step SAVE_KILLED: every rank file and meta.json written, COMPLETE not;
- attempt 2 on: no crash.
"""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]  # (torchrun puts tests/ first only)

from graded import load_lesson  # noqa: E402  (DP_LESSONS: a student edition's lesson)
from lessonkit import checkpoint, lifecycle  # noqa: E402

KILL_AFTER = 3
SAVE_KILLED = 4


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def crash_on(attempt, rank, world):
    if attempt == 0 and rank == world - 1:
        maybe_save = checkpoint.Checkpointer.maybe_save

        def maybe_save_or_die(self, step):
            if step == KILL_AFTER:
                die()
            maybe_save(self, step)
        checkpoint.Checkpointer.maybe_save = maybe_save_or_die
    if attempt == 1 and rank == 0:
        write = checkpoint._write_atomic  # save() writes COMPLETE last, through this

        def write_or_die(path, what):
            if path.endswith(os.path.join(f"step_{SAVE_KILLED:06d}", "COMPLETE")):
                die()
            write(path, what)
        checkpoint._write_atomic = write_or_die


if __name__ == "__main__":
    lesson, argv = sys.argv[1], sys.argv[2:]
    crash_on(*(int(os.environ.get(k, d)) for k, d in
               (("TORCHELASTIC_RESTART_COUNT", "0"), ("RANK", "0"), ("WORLD_SIZE", "1"))))
    lifecycle.run_main(lambda: load_lesson(lesson).main(argv))
