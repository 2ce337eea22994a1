"""Bad input gets one clear line from rank 0 and a non-zero exit, never a traceback or a hang."""
import glob
import os
import re
import subprocess
import sys
import tempfile

import pytest

from graded import lesson_file
from harness import ROOT
from scripts.runs import LESSONS

# no GPU visible, so `--device cuda` fails the same way on a machine with GPUs
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")


def run_all(commands, timeout=120, envs=None):
    """Start the commands together (each pays ~3 s of `import torch`), return (code, stderr).
    envs: variables added to each command's environment, one dict per command."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(ENV, **extra), text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for cmd, extra in zip(commands, envs or [{}] * len(commands))]
    return [(p.wait(timeout), p.communicate()[1]) for p in procs]


BAD = [
    # --simulate-world (lessonkit/simulate.py): a rank outside the world, what needs data (a whole
    # model no machine holds: test_a_simulated_lesson_refuses_a_whole_model_the_machine_cannot_hold)
    (["--simulate-rank", "2"], "--simulate-rank needs --simulate-world N"),
    (["--simulate-world", "4", "--simulate-rank", "4"], "the rank 0 to N - 1"),
    (["--simulate-world", "4", "--trace", "t"], "a simulated world moves no data"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--global-batch", "7", "--grad-accum", "2"], "--global-batch 7 must be divisible by world size 1 x --grad-accum 2"),
    (["--device", "cuda"], "no CUDA GPU is available"),
    (["--steps", "0"], "--steps must be at least 1"),
    # nan compares false with everything: each bound is written so that it fails there too
    (["--weight-decay", "nan"], "--weight-decay must be 0 or positive and below 2^32, got nan"),
    (["--weight-decay", "inf"], "--weight-decay must be 0 or positive and below 2^32, got inf"),
    (["--chunk-mb", "-1"], "--chunk-mb must be 0 or positive and below 2^32, got -1.0"),
    (["--chunk-mb", "nan"], "--chunk-mb must be 0 or positive and below 2^32, got nan"),
    # (a seed past 64 bits once ended in "Overflow when unpacking long long"; 1e300 decay, in nan)
    (["--seed", str(2 ** 64)], f"--seed must be 0 or positive and below 2^32, got {2 ** 64}"),
    (["--seed", "-1"], "--seed must be 0 or positive and below 2^32, got -1"),
    (["--weight-decay", "1e300"], "--weight-decay must be 0 or positive and below 2^32, got 1e+300"),
    (["--lr", "nan"], "--bucket-mb must be positive, --lr and --grad-clip 0 or positive, --timeout 1 to 86400 seconds (finite numbers"),
    (["--lr", "inf"], "--bucket-mb must be positive, --lr and --grad-clip 0 or positive, --timeout 1 to 86400 seconds"),
    (["--lr=-1e-3"], "--bucket-mb must be positive, --lr and --grad-clip 0 or positive, --timeout 1 to 86400 seconds"),
    (["--grad-clip", "nan"], "--bucket-mb must be positive, --lr and --grad-clip 0 or positive, --timeout 1 to 86400 seconds"),
    (["--grad-clip", "-0.5"], "--bucket-mb must be positive, --lr and --grad-clip 0 or positive, --timeout 1 to 86400 seconds"),
    (["--bucket-mb", "nan"], "--bucket-mb must be positive, --lr and --grad-clip 0 or positive, --timeout 1 to 86400 seconds"),
    (["--timeout", "inf"], "--bucket-mb must be positive, --lr and --grad-clip 0 or positive, --timeout 1 to 86400 seconds"),
    # (below a second gloo's connect gave up at once, in a wall of C++ frames; 1e300 overflowed a C int)
    (["--timeout", "1e-9"], "--timeout 1 to 86400 seconds"), (["--timeout", "1e300"], "--timeout 1 to 86400 seconds"),
    (["--n-head", "3"], "--d-model 128 must be divisible by --n-head 3"),
    (["--link", "1"], "--link '1': expected GBPS:LATENCY_US, e.g. 1:50"),
    (["--link", "fast:50"], "--link 'fast:50': expected GBPS:LATENCY_US"),
    (["--link", "0:50"], "--link '0:50': the bandwidth must be 0.001 Gb/s or more and the latency 0 to 1000000 us (1 s)"),
    (["--link", "1:-5"], "the bandwidth must be 0.001 Gb/s or more and the latency 0 to 1000000 us"),
    # (a latency of 11 days, 1e12 us, was taken: the run hung in its first send)
    (["--link", "1:1e12"], "the latency 0 to 1000000 us (1 s)"), (["--link", "1e-300:0"], "the bandwidth must be 0.001 Gb/s or more"),
    (["--link", "1:50", "--collectives", "torch"], "--link simulates a link for the ring"),
    (["--collectives", "ring", "--device", "cuda"], "--collectives ring sends over gloo on the CPU"),
    (["--shard-group", "3"], "--shard-group 3 must be at least 1 and divide world size 1"),
    (["--shard-group", "0"], "--shard-group 0 must be at least 1 and divide world size 1"),
    (["--inter-link", "1:50"], "--inter-link needs nodes: --ranks-per-node G (08: its --shard-group G is the node)"),
    (["--ranks-per-node", "1"], "--ranks-per-node 1 needs --inter-link: the ranks sit on nodes for a link between them"),
    (["--vocab-size", "1"], "--vocab-size must be at least 2 and below 2^32, got 1"),  # (one token: every loss 0)
    (["--loss-scale", "1000", "--precision", "fp16"], "argument --loss-scale: a power of two from 2^-126 to 2^127, such as 65536 or 1048576, got 1000"),
    (["--loss-scale", "0"], "argument --loss-scale: a power of two from 2^-126 to 2^127, such as 65536 or 1048576, got 0"),
    (["--loss-scale", "-1024"], "argument --loss-scale: a power of two"),
    (["--loss-scale", "inf"], "argument --loss-scale: a power of two"),
    (["--loss-scale", "7.174648137343064e-43"], "a power of two from 2^-126 to 2^127"),  # 2^-140: 1/S is inf in fp32
    (["--loss-scale", str(2.0 ** 128)], "a power of two from 2^-126 to 2^127"),  # inf as fp32
    (["--loss-scale", "big"], "argument --loss-scale: a power of two from 2^-126 to 2^127, such as 65536 or 1048576, got big"),
    (["--checkpoint-dir", __file__, "--save-every", "1"], f"--checkpoint-dir {__file__} is a file, not a directory"),
    (["--checkpoint-dir", "ckpt"], "--checkpoint-dir ckpt alone saves and resumes nothing: add --save-every K"),
    # made before the first step (it once failed at the first save, a rank's traceback beside it)
    (["--checkpoint-dir", f"{__file__}/sub", "--save-every", "1"],
     f"--checkpoint-dir {__file__}/sub cannot be made: Not a directory"),
    # (it once trained on and wrote nothing: a job script's --resume auto would restart from scratch)
    (["--save-every", "100", "--steps", "10", "--checkpoint-dir", f"{__file__}/sub"],  # (not made: refused first)
     "--save-every 100 is more than --steps 10: no checkpoint would be written"),
    # the report's and the trace's folders, like the checkpoints': made before the first step, or refused then
    # (a report that could not be written once failed at the run's end, after all its steps)
    (["--report", os.path.dirname(__file__)], f"--report {os.path.dirname(__file__)} is a directory: give the path"),
    (["--report", f"{__file__}/r.json"], f"--report {__file__}/r.json: its directory {__file__} is a file, not a directory"),
    (["--trace", __file__], f"--trace {__file__} is a file, not a directory"),
    # (an empty path was once taken for none given: the run wrote no report, no trace, no checkpoint)
    (["--report", ""], "--report '': give a path"), (["--trace", ""], "--trace '': give a path"),
    (["--checkpoint-dir", "", "--save-every", "1"], "--checkpoint-dir '': give a path"),
    (["--loss-scale", "1024"], "--loss-scale 1024: only fp16 scales its loss (use it with --precision fp16)"),
    (["--precision", "bf16", "--loss-scale", "1024"], "--loss-scale 1024: only fp16 scales its loss"),
]


# whole processes, one per way a run can stop: argparse, parse_args' checks, the device (two: they
# stop in init_distributed), a tool, and lessons other than 01 (each pays ~1.5 s of `import torch`:
# the rest run in this process, through the same parser and fail())
END_TO_END = {"--precision": "01_vanilla_dp", "--global-batch": "01_vanilla_dp", "--device": "01_vanilla_dp",
              "--collectives": "02_async_allreduce", "--inter-link": "08_hybrid"}


def test_a_simulated_lesson_refuses_a_whole_model_the_machine_cannot_hold(monkeypatch, capsys):
    from lessonkit import common  # 05 builds it before sharding: 4 Psi = 618 GB here, in fp32
    parse = lambda argv: common.parse_args(argv, description="Lesson 05: ZeRO-2")  # noqa: E731
    flags = ["--simulate-world", "64", "--n-layer", "48", "--d-model", "16384", "--n-head", "128"]
    assert "lesson 05 builds the whole model before it shards it" in error_of(parse, flags, monkeypatch, capsys)


def test_bad_flags_one_line_nonzero_exit():
    commands = [[sys.executable, lesson_file(END_TO_END[flags[0]]), *flags] for flags, _ in BAD if flags[0] in END_TO_END]
    expected = [msg for flags, msg in BAD if flags[0] in END_TO_END]
    # 00 runs its own ring beside torch's; the PyTorch references call the process group themselves
    commands += [[sys.executable, lesson_file("00_collectives"), "--collectives", "ring"],
                 [sys.executable, "-m", "scripts.perf.torch_reference", "--collectives", "ring"]]
    expected += ["00 compares its own ring with torch's collectives", "the PyTorch references run on torch's collectives only"]
    # 08's node is its shard group: a --ranks-per-node of another size is refused
    commands += [[sys.executable, lesson_file("08_hybrid"), "--inter-link", "1:50", "--ranks-per-node", "1",
                  "--shard-group", "2"]]
    expected += ["--ranks-per-node 1 and --shard-group 2 disagree: 08's node is its shard group (give one of the two)"]
    # a tool's own: a size of 0 bytes once ended in ZeroDivisionError
    commands += [[sys.executable, "-m", "scripts.perf.bandwidth", "--sizes", "0"]]
    expected += ["every size must be a positive multiple of 4 x 1 bytes, got 0"]
    for (code, err), msg in zip(run_all(commands), expected):
        assert code == 2, err
        lines = [l for l in err.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], err


# torchrun's variables, garbled or without torchrun: each once ended otherwise (in brackets)
TORCHRUN_ENV = [
    # (trained alone at world 1, its batch checked against world 2)
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but no RANK: start the ranks with torchrun --nproc_per_node=2, or unset WORLD_SIZE"),
    # (int()'s "invalid literal for int() with base 10: 'abc'")
    ({"LOCAL_WORLD_SIZE": "abc"}, "LOCAL_WORLD_SIZE='abc' in the environment is not a count of ranks: torchrun sets it"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' in the environment is not a count of ranks"),  # (ZeroDivisionError)
    ({"WORLD_SIZE": "\u00b2"}, "WORLD_SIZE='\u00b2' in the environment is not a count of ranks"),  # (a digit to isdigit(), not to int())
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' in the environment is not a rank"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' in the environment is not a rank"),
    # (no line: a rank other than 0 leaves the saying to rank 0, which does not exist here)
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 in the environment is not below WORLD_SIZE=2: torchrun sets both"),
]


def test_torchruns_variables_garbled_or_alone_are_one_line():
    commands = [[sys.executable, lesson_file("01_vanilla_dp"), "--steps", "1"] for _ in TORCHRUN_ENV]
    for (code, err), (env, msg) in zip(run_all(commands, envs=[env for env, _ in TORCHRUN_ENV]), TORCHRUN_ENV):
        lines = [l for l in err.splitlines() if l.strip()]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], (env, err)


def test_a_run_whose_loss_is_not_finite_exits_1_with_one_line():
    """--lr 1e308 is a valid float: the first step makes every parameter nan. It once printed
    "final loss nan" and exited 0, which a script or a grader takes for a result."""
    small = ["--steps", "3", "--n-layer", "1", "--d-model", "32", "--n-head", "2", "--seq-len", "16",
             "--global-batch", "4", "--peak-params", "0"]
    [(code, err)] = run_all([[sys.executable, lesson_file("04_zero1"), *small, "--lr", "1e308"]])
    assert code == 1, err
    errors = [l for l in err.splitlines() if l.startswith("error")]
    assert errors == ["error: the loss is nan from step 1 on: training diverged (the summary above); "
                      "a smaller --lr, --warmup-steps or --grad-clip may help"], err


# every tool's command line (scripts.runs.Parser): found by its call, so a new tool is held to it too
TOOLS = sorted(os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".") for path in
               glob.glob(os.path.join(ROOT, "scripts", "**", "*.py"), recursive=True) + [os.path.join(ROOT, "tests", "fuzz.py")]
               if re.search(r'\bParser\("', open(path, encoding="utf-8").read()))
PASSED_ON = {"scripts.learn.lecture": ["--nproc", "0"], "scripts.perf.sweep": ["--worlds", "0"]}  # (the rest: the lessons')


@pytest.mark.parametrize("module", TOOLS)
def test_a_tools_bad_flag_is_one_line_and_exit_2(module, monkeypatch, capsys):
    import importlib
    main = importlib.import_module(module).main
    monkeypatch.setattr(sys, "argv", [module, *PASSED_ON.get(module, ["--bogus"])])
    with pytest.raises(SystemExit) as stop:
        main()
    err = capsys.readouterr().err
    name = "gpu-check" if module.endswith("gpu_check") else module.split(".")[-1]
    assert stop.value.code == 2 and err.startswith(f"{name}: error: ") and err.count("\n") == 1, err


def test_the_tools_are_found():  # (an empty TOOLS would skip the test above, not fail it)
    assert len(TOOLS) >= 18 and {"scripts.perf.bench", "scripts.learn.lecture", "tests.fuzz"} <= set(TOOLS), TOOLS


def error_of(main, argv, monkeypatch, capsys):
    """In this process: the message `main(argv)` stops with, through argparse (stderr) or
    common.fail (raising here instead of ending the process)."""
    from lessonkit import common

    def fail(message):
        raise SystemExit(f"error: {message}")
    monkeypatch.setattr(common, "fail", fail)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return str(stop.value) if isinstance(stop.value.code, str) else capsys.readouterr().err


@pytest.mark.parametrize("flags, msg", [row for row in BAD if row[0][0] not in END_TO_END])
def test_bad_flags_name_themselves(flags, msg, monkeypatch, capsys):
    from lessonkit import common
    assert msg in error_of(common.parse_args, flags, monkeypatch, capsys)


def test_the_reports_and_the_traces_folders_are_made_before_the_first_step(tmp_path, monkeypatch):
    from lessonkit import common
    monkeypatch.setenv("WORLD_SIZE", "1")
    common.parse_args(["--report", str(tmp_path / "runs" / "06" / "report.json"), "--trace", str(tmp_path / "trace")])
    assert (tmp_path / "runs" / "06").is_dir() and (tmp_path / "trace").is_dir()
    assert not (tmp_path / "runs" / "06" / "report.json").exists()  # written at the end, by rank 0


@pytest.mark.parametrize("name", LESSONS[1:])
def test_every_lesson_parses_the_shared_flags(name, monkeypatch, capsys):
    # 02-08 reject an unknown precision as 01 does (their main() parses with common.parse_args)
    from scripts.runs import load_lesson
    assert "invalid choice: 'fp8'" in error_of(load_lesson(name).main, ["--precision", "fp8"], monkeypatch, capsys)


# a lesson's own flag given to another lesson, which would ignore it (and 00 trains nothing)
@pytest.mark.parametrize("name, flags, msg", [
    ("06_zero3", ["--layout", "uneven"], "--layout is for lesson 07 only: lesson 06 would ignore it"),
    ("06_zero3", ["--chunk-mb", "2"], "--chunk-mb is for lesson 07 only: lesson 06 would ignore it"),
    ("07_offload", ["--shard-group", "1"], "--shard-group is for lesson 08 only: lesson 07 would ignore it"),
    # 01-04 reduce once a step already (02, 03: no_sync; 01, 04: after the last backward)
    ("04_zero1", ["--reduce-every", "step"], "--reduce-every is for lessons 05 06 07 08 only: lesson 04 would ignore it"),
    ("07_offload", ["--all-reduce-every", "step"], "--all-reduce-every is for lesson 08 only: lesson 07 would ignore it"),
    ("00_collectives", ["--precision", "bf16"], "--precision is for lessons 01-09 only: lesson 00 would ignore it"),
    ("00_collectives", ["--grad-accum", "2"], "--grad-accum is for lessons 01-09 only"),
    ("00_collectives", ["--activation-checkpointing", "block"], "--activation-checkpointing is for lessons 01-09 only"),
    ("00_collectives", ["--checkpoint-dir", "ckpt"], "--checkpoint-dir is for lessons 01-09 only"),
    # (once run as if given: 00 takes the GPT's shape, --seed, --link and the run's own flags only)
    ("00_collectives", ["--steps", "5"], "--steps is for lessons 01-09 only: lesson 00 would ignore it"),
    ("00_collectives", ["--lr", "1"], "--lr is for lessons 01-09 only"),
    ("00_collectives", ["--global-batch", "3"], "--global-batch is for lessons 01-09 only"),
    ("00_collectives", ["--trace", os.path.join(tempfile.gettempdir(), "refused")], "--trace is for lessons 01-09 only"),
    ("00_collectives", ["--inter-link", "1:50", "--ranks-per-node", "1"], "--inter-link is for lessons 01-09 only"),
])
def test_a_flag_the_lesson_would_ignore_is_refused(name, flags, msg, monkeypatch, capsys):
    from scripts.runs import load_lesson
    assert msg in error_of(load_lesson(name).main, flags, monkeypatch, capsys)


def test_each_lesson_takes_its_own_flags():
    from lessonkit import common
    # (and the tuning knobs, --bucket-mb and --prefetch, anywhere: a sweep passes one set of flags to all)
    for lesson, flags in (("03", ["--bucket-mb", "1"]), ("08", ["--prefetch", "0", "--shard-group", "1"]),
                          ("07", ["--layout", "uneven", "--prefetch", "0", "--chunk-mb", "2", "--reduce-every", "step"]),
                          ("08", ["--reduce-every", "step", "--all-reduce-every", "step"]), ("01", ["--precision", "bf16"]),
                          ("04", ["--bucket-mb", "1", "--prefetch", "0"]),
                          ("00", ["--seed", "3", "--n-layer", "1", "--d-model", "8", "--n-head", "2", "--seq-len", "4",
                                  "--vocab-size", "5", "--link", "1:50", "--timeout", "9", "--device", "cpu", "--bucket-mb", "1"])):
        common.parse_args(flags, description=f"Lesson {lesson}: x")


@pytest.mark.parametrize("flags, msg", [
    (["--inter-link", "fast:50", "--ranks-per-node", "1"], "--inter-link 'fast:50': expected GBPS:LATENCY_US"),
    (["--inter-link", "1:50", "--ranks-per-node", "1", "--collectives", "torch"], "--inter-link simulates a link for the ring"),
    (["--inter-link", "1:50", "--ranks-per-node", "0"], "--ranks-per-node 0 must be at least 1 and divide world size 1"),
    (["--inter-link", "1:50", "--ranks-per-node", "2"], "--ranks-per-node 2 must be at least 1 and divide world size 1"),
])
def test_bad_node_flags_fail_with_their_line(flags, msg, monkeypatch):
    # the rest of --inter-link's checks, in this process (fail() would end it: it raises here instead)
    from lessonkit import common

    def fail(message):
        raise SystemExit(message)
    monkeypatch.setattr(common, "fail", fail)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match=re.escape(msg)):
        common.parse_args(flags)


def test_the_node_is_the_shard_group_and_a_slower_link_between_nodes_means_the_ring():
    from lessonkit import common
    for flags in (["--inter-link", "1:50", "--ranks-per-node", "1"], ["--inter-link", "1:50", "--shard-group", "1"]):
        args = common.parse_args(flags)
        assert (args.collectives, args.ranks_per_node, args.shard_group) == ("ring", 1, 1), flags
    assert common.parse_args(["--shard-group", "1"]).collectives == "torch"


def test_batch_not_divisible_by_world_size_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           lesson_file("03_buckets"), "--global-batch", "7"]
    [(code, err)] = run_all([cmd])
    assert code != 0
    ours = [l for l in err.splitlines() if l.startswith("error: ")]
    # rank 0 alone speaks; what follows it is torchrun's own failure report
    assert ours == ["error: --global-batch 7 must be divisible by world size 2 x --grad-accum 1"], err
    assert "error (rank" not in err  # rank 1, stopped by torchrun, adds nothing of its own
    assert "03_buckets.py\", line" not in err  # no traceback from the lesson itself


def test_help_keeps_the_launch_commands_and_explains_every_flag():
    from lessonkit import common
    doc = "Lesson: one line.\n\n    torchrun --nproc_per_node=2 x.py        # 2 ranks\n    python x.py     # one\n"
    parser = common.build_parser(doc)
    text = parser.format_help()
    assert "    torchrun --nproc_per_node=2 x.py        # 2 ranks\n    python x.py     # one\n" in text
    flags = [a for a in parser._actions if a.option_strings != ["-h", "--help"]]
    assert flags and all(a.help for a in flags), [a.dest for a in flags if not a.help]
    groups = [g.title for g in parser._action_groups if g._group_actions]
    assert groups[-5:] == ["data and model", "optimisation", "communication", "checkpoints (checkpoint.py)",
                           "run-time and measurement"]


# the tools' counts and limits (scripts.runs.at_least): a zero, a negative, nan or a word is one
# line and exit 2, before anything starts (each once crashed, hung or ran with a default)
@pytest.mark.parametrize("tool, argv, msg", [
    ("scripts.learn.demo", ["--nproc", "0"], "argument --nproc: must be at least 1 (and finite), got 0"),
    ("scripts.learn.demo", ["--steps", "0"], "argument --steps: must be at least 1"),
    ("scripts.learn.lecture", ["--nproc", "0"], "argument --nproc: must be at least 1"),
    ("scripts.perf.bench", ["--rounds", "0"], "argument --rounds: must be at least 1"),
    ("scripts.perf.bench", ["--nproc", "two"], "argument --nproc: not a number: 'two'"),
    ("scripts.perf.scaling", ["--worlds", "1", "0"], "argument --worlds: must be at least 1"),
    ("scripts.perf.profile_step", ["01_vanilla_dp", "--count", "-1"], "argument --count: must be at least 1"),
    ("scripts.course.grade", ["--test-timeout", "nan"], "argument --test-timeout: must be at least 1 (and finite), got nan"),
    ("scripts.course.grade_class", [".", "--jobs", "0"], "argument --jobs: must be at least 1"),
    ("scripts.learn.zero_calc", ["--params", "1e9", "--k", "nan"], "argument --k: must be at least 0 (and finite), got nan"),
])
def test_a_tools_bad_count_is_one_line(tool, argv, msg, monkeypatch, capsys):
    import importlib
    monkeypatch.setattr(sys, "argv", [tool, *argv])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(tool).main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and err.count("\n") == 1, err  # (no usage block above it)


# a tool's folders and files, before anything runs (each once ended in a traceback; bench's after
# all its runs)
@pytest.mark.parametrize("tool, argv, msg", [
    ("scripts.perf.bench", ["--out", __file__], f"bench: error: --out {__file__}: cannot be made: File exists"),
    ("scripts.perf.scaling", ["--out", f"{__file__}/x"], f"scaling: error: --out {__file__}/x: cannot be made: Not a directory"),
    ("scripts.perf.scaling", ["--replot", "--out", "/nonexistent"], "--replot: there is no /nonexistent/scaling.json"),
    ("scripts.perf.scaling", ["--quick", "--worlds", "4"], "--quick runs worlds 1 and 2 only"),  # (none left: max() of [])
    ("scripts.perf.timelines", ["--out", __file__], "timelines: error: --out"),
    ("scripts.course.grade_class", [".", "--out", __file__], "grade_class: error: --out"),
    ("scripts.course.grade", ["--points", "/nonexistent.toml"], "error: --points /nonexistent.toml: No such file or directory"),
    ("scripts.course.grade", ["--points", __file__], f"error: --points {__file__}: "),  # not TOML
    ("scripts.course.student_edition", ["out", "--source", "/nonexistent"], "--source /nonexistent: no such directory"),
    ("tests.fuzz", ["--case", "{}"], "fuzz: error: --case: not a case as a failure prints it (KeyError: 'model')"),
    ("tests.fuzz", ["--case", "[1]"], "fuzz: error: --case: not a case as a failure prints it (TypeError"),
])
def test_a_tools_bad_path_is_one_line(tool, argv, msg, monkeypatch, capsys):
    import importlib
    monkeypatch.setattr(sys, "argv", [tool, *argv])
    with pytest.raises(SystemExit) as e:
        code = importlib.import_module(tool).main()
        sys.exit(code)
    err = capsys.readouterr().err
    assert e.value.code not in (0, None) and err.count("\n") <= 1 and msg in (err or str(e.value.code)), (err, e.value.code)
