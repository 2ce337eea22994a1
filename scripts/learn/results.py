"""docs/results.md: the measured numbers the README and docs link to, from runs of this checkout.

    make results        # every lesson at 2 ranks on CPU (make demo's table), written with one
                        # header line: the machine, torch and the commit it ran

The GPU section is `make gpu-check`'s (scripts/perf/gpu_check.py writes it where a GPU ran it);
each section is replaced whole by the target that measures it, the others kept as they are.
"""
import os
import platform
import re
import subprocess
import sys

import torch

from scripts.learn import demo
from scripts.runs import ROOT, tool_main

PATH = os.path.join(ROOT, "docs", "results.md")
TITLE = "# Results\n\nMeasured by the make targets named in each section, on the machine its first line names.\n"


def machine():
    """One line: the CPU (or GPU), the cores, torch, the commit (-dirty: with uncommitted changes)."""
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = re.findall(r"model name\s*:\s*(.+)", open("/proc/cpuinfo").read())
        cpu = names[0].strip() if names else cpu
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = (git("rev-parse", "--short", "HEAD") or "unknown") + ("-dirty" if git("status", "--porcelain") else "")
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, commit {commit}"


def write_section(name, body):
    """Replace section `name` of docs/results.md (between its markers) with `body`, keep the rest."""
    text = open(PATH).read() if os.path.exists(PATH) else TITLE
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(PATH, "w") as f:
        f.write(text)


def main():
    nproc, precision, steps = 2, "fp32", 40
    rows = demo.collect(nproc, precision, steps, echo=True)
    write_section("cpu", "\n".join([
        "## Every lesson on CPU", "",
        f"Machine: {machine()}. `make results` (the table `make demo` prints).", "",
        demo.caption(nproc, precision, steps) + ".", "",
        "```", *demo.table(rows), "```"]))
    print(f"wrote {os.path.relpath(PATH, ROOT)}")


if __name__ == "__main__":
    sys.exit(tool_main("results", main))
