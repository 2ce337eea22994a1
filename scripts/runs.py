"""Launch lessons with torchrun and read their JSON reports (used by the demo, the benchmark,
the figures and the notebooks). Not part of any lesson."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the trainers (00_collectives.py trains nothing: it runs on its own, and is tested on its own)
LESSONS = ["01_vanilla_dp", "02_async_allreduce", "03_buckets", "04_zero1", "05_zero2", "06_zero3", "07_offload",
           "08_hybrid"]
# the lessons that take --precision fp16 (all of them; a lesson added later joins when it does):
# for every tool that runs fp16 (the GPU check, the demo) and for the differential fuzzer
FP16_LESSONS = list(LESSONS)


class Parser(argparse.ArgumentParser):
    """A tool's command line: --help prints its docstring as written, and bad input is one line,
    `<tool>: error: ...` and exit 2, as the lessons' flags, not argparse's usage block."""

    def __init__(self, prog, **kwargs):
        super().__init__(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def folder(self, flag, path):
        """Make the folder a tool writes to before it runs anything (a file there, or one that
        cannot be made, once failed with a traceback after all its runs); return it."""
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            self.error(f"{flag} {path}: cannot be made: {e.strerror or e}")
        return path


def at_least(low, kind=int):
    """An argparse type for a tool's counts and limits: a `kind`, at least `low` and finite (nan,
    which compares false with everything, fails too); argparse prints the one-line error."""
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not low <= x < float("inf"):
            raise argparse.ArgumentTypeError(f"must be at least {low:g} (and finite), got {text}")
        return x
    return parse


def usable_cpus():
    """The CPUs this process may run on: under a container's or taskset's CPU mask that is fewer
    than the machine has (os.cpu_count()), and more threads or ranks than these only take turns."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity off Linux (macOS, Windows)
        return os.cpu_count() or 1


def grid_args(script, nproc, args=()):
    """08's grid when the caller names none: two "nodes" of nproc / 2 ranks (1 x 1 alone), so a
    tool's 08 row shows hybrid sharding, not 08's default on one node: one group (06)."""
    if script != "08_hybrid" or "--shard-group" in map(str, args):
        return []
    return ["--shard-group", str(nproc // 2 if nproc % 2 == 0 else nproc)]


def available_lessons():
    """The lessons present in this checkout, in reading order."""
    return [name for name in LESSONS if os.path.exists(os.path.join(ROOT, f"{name}.py"))]


class LaunchFailed(RuntimeError):
    """A launch that exited non-zero; its message: the command's line, then the run's output."""


def why_failed(e):
    """A failed launch in one line: the run's own error line, else how torchrun exited. (The
    error holds the command's line, then the run's output, torchrun's traceback included.)"""
    lines = str(e).splitlines()
    said = next((line for line in lines[1:] if line.lower().startswith("error")), None)
    return said or "exited " + lines[0].split()[-1].rstrip(":")


def tool_main(name, main):
    """Run a tool's `main`: a launch that fails ends the tool with one line, the run's own error,
    and exit 1, the command and its whole output in runs/<name>/failed_run.log, not a traceback."""
    try:
        return main()
    except LaunchFailed as e:
        path = os.path.join(ROOT, "runs", name, "failed_run.log")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(f"{e}\n")
        sys.exit(f"{name}: a run failed: {why_failed(e)} (its command and output: {os.path.relpath(path)})")


def launch(script, nproc, args=(), echo=False, report=True, threads=1, env=None):
    """Run `script` (a lesson's name, or a tool's module such as "scripts.perf.sweep") on `nproc` CPU ranks (gloo, also on a
    machine with GPUs; a `--device` in args overrides), `threads` each, `env` added to the
    environment; return its report (a dict) or raise LaunchFailed with the run's output."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        # one rank runs as `python 01_vanilla_dp.py` does: torchrun's agent, another interpreter
        # importing torch, would add seconds a launch and nothing else
        runner = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
        cmd = [sys.executable, *runner, *(["-m", script] if "." in script else [os.path.join(ROOT, f"{script}.py")]),
               "--device", "cpu", *map(str, args), *grid_args(script, nproc, args)]
        if report:
            cmd += ["--report", path]
        env = dict(os.environ, **(env or {}), OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)
        output = proc.stdout + "".join(l + "\n" for l in proc.stderr.splitlines()
                                       if not l.startswith(("W", "I")) or "error" in l.lower())
        if proc.returncode != 0:  # (not echoed: torchrun's traceback is in it; tool_main says one line)
            raise LaunchFailed(f"{' '.join(cmd)} exited {proc.returncode}:\n{output}")
        if echo:
            print(output, end="", flush=True)
        if not report:
            return output
        with open(path) as f:
            return json.load(f)


def mib(x):
    return x / 2 ** 20


def device_and_host(mem):
    """A report's memory entry (one rank's) as (bytes on the device, bytes on the host, or None):
    07 splits its model states by tier, and its point is the device's share; every other lesson
    keeps all of params + grads + optimizer on its device."""
    held = lambda m: m["params"] + m["grads"] + m["optimizer"]  # noqa: E731
    return (held(mem["device"]), held(mem["host"])) if "host" in mem else (held(mem), None)


def load_lesson(name):
    """Import `04_zero1.py` (not a valid module name) as a module; nothing runs at import."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
