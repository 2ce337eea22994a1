"""Every lesson, one after another, at several world sizes, in ONE launch.

    torchrun --nproc_per_node=4 -m scripts.perf.sweep --report sweep.json --worlds 4 2 1 --precision bf16 --steps 3
    python -m scripts.perf.sweep --report sweep.json --lessons 04_zero1 "06_zero3 --prefetch 0"   # world size 1

Every flag the sweep does not know goes to each lesson unchanged. Each lesson's main() builds its
own model, strategy and optimizer and returns its Run; rank 0 collects the reports into one JSON
file: {"flags": [...], "worlds": {"4": {"world_size": 4, "reports": {run: report},
"seconds": {run: s}}, "2": ...}}. A run is a lesson name, optionally with flags of its own that
override the shared ones, in one word: "06_zero3 --prefetch 0".

Why one launch: torchrun costs 6-9 s of start-up on a 2-core CPU, a lesson with a small model well
under a second. So the sweep starts all ranks once, runs every lesson at the largest world size,
then re-forms the default process group from the first N ranks for each smaller N (the others are
done and leave). This is how the notebooks and `make figures` measure every lesson at every size.

Running lessons back to back in one process is sound because (checked here, not assumed):
- nothing runs at import, and common.init_distributed joins the group that already exists;
- a lesson's main() returns only after Run.finish(), whose all_gather_object is a blocking
  collective every rank reaches after its last step: no collective of one lesson is still in
  flight when the next starts (a barrier between lessons makes the hand-over explicit);
- the meter patches torch.distributed only inside the measured step and restores it after;
- lessons register hooks only on the modules they build, and a lesson's objects are dropped and
  garbage collected before the next one builds its own;
- each world size gets a fresh default process group over its own key prefix in the launch's
  store, so nothing of one group's rendezvous is seen by the next.
"""
import gc
import json
import os
import time
from datetime import timedelta

import torch.distributed as dist

from lessonkit import common, lifecycle
from scripts.runs import ROOT, Parser, at_least, available_lessons, grid_args, load_lesson

NO_PREFETCH = "06_zero3 --prefetch 0"


def regroup(world, rank, store, timeout):
    """Make the first `world` ranks the default process group; False for the ranks left out."""
    backend = dist.get_backend()  # the launch's: the lessons' device follows it
    dist.destroy_process_group()
    if rank >= world:
        lifecycle.leaving_on_purpose(store, rank)  # (on NCCL the others watch every launched rank)
        return False
    os.environ["WORLD_SIZE"] = str(world)  # what common.parse_args checks the batch against
    dist.init_process_group(backend, store=dist.PrefixStore(f"sweep/world{world}", store),
                            rank=rank, world_size=world, timeout=timeout)
    return True


def run_lessons(runs, flags, track_peak):
    out = {"world_size": dist.get_world_size(), "reports": {}, "seconds": {}}
    for name in runs:
        lesson, *extra = name.split()
        t0 = time.perf_counter()
        untracked = [] if track_peak is None or name in track_peak else ["--peak-params", "0"]
        grid = grid_args(lesson, dist.get_world_size(), [*flags, *extra])  # 08: two "nodes"
        run = load_lesson(lesson).main([*flags, *extra, *untracked, *grid])  # after the sweep's flags: they win
        out["reports"][name] = run.final_report  # None on ranks other than 0
        out["seconds"][name] = time.perf_counter() - t0
        del run  # the lesson's model, strategy and optimizer go before the next one is built
        gc.collect()
        dist.barrier()
    return out


def main():
    p = Parser("sweep", description=__doc__)
    p.add_argument("--report", required=True, help="where rank 0 writes every report (JSON)")
    p.add_argument("--worlds", type=at_least(1), nargs="+", default=None,
                   help="world sizes to run, each at most the number of ranks launched (default: that number)")
    p.add_argument("--lessons", nargs="+", default=None, metavar="RUN",
                   help=f"runs at every world size (default: every lesson, and {NO_PREFETCH!r})")
    p.add_argument("--at", nargs="+", action="append", default=[], metavar=("WORLD", "RUN"),
                   help="more runs at one world size only, e.g. --at 4 '06_zero3 --n-layer 6'")
    p.add_argument("--track-peak", nargs="*", default=None, metavar="RUN",
                   help="the runs whose parameter bytes are sampled after every operation of the "
                        "measured step (peak_params and its timeline; ~2 ms per operation). "
                        "Default: all; with no names: none")
    ours, flags = p.parse_known_args()
    if "--report" in flags:
        lifecycle.fail("--report is the sweep's own output; the lessons' reports are collected into it")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    worlds = sorted(set(ours.worlds or [launched]), reverse=True)
    if worlds[0] > launched or worlds[-1] < 1:
        lifecycle.fail(f"--worlds {ours.worlds}: each must be between 1 and the {launched} ranks launched")
    lessons = available_lessons()
    runs = ours.lessons or [run for l in lessons for run in ([l, NO_PREFETCH] if l == "06_zero3" else [l])]
    extra = {}
    for world, *names in ours.at:
        if not world.isdigit() or int(world) not in worlds or not names:
            lifecycle.fail(f"--at {world} ...: give one of the world sizes {worlds}, then runs")
        extra.setdefault(int(world), []).extend(names)
    for name in runs + [n for names in extra.values() for n in names]:
        named = name.split()[0]  # a lesson of the tools' list, or a numbered file named outright
        if named not in lessons and not (named[:2].isdigit() and os.path.exists(os.path.join(ROOT, f"{named}.py"))):
            lifecycle.fail(f"no lesson {name.split()[0]!r}; available: {' '.join(lessons)}")
    # the lessons' own parser checks the shared flags once, up front: one line from rank 0 if bad
    args = common.parse_args(flags)
    env = common.init_distributed(args)
    rank, store = env.rank, dist.distributed_c10d._get_default_store()  # the launch's store
    out = {"flags": flags, "worlds": {}}
    for world in worlds:
        if world != dist.get_world_size() and not regroup(world, rank, store, timedelta(seconds=args.timeout)):
            break  # not in this (nor any smaller) group: this rank is done
        names = runs + [n for n in extra.get(world, []) if n not in runs]
        out["worlds"][str(world)] = run_lessons(names, flags, ours.track_peak)
    if rank == 0:
        with open(ours.report, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    lifecycle.run_main(main)
