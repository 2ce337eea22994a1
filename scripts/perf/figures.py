"""Regenerate the README's figures: execute both notebooks from fresh runs, headless.

    make figures                                   # or: .venv/bin/python -m scripts.perf.figures
    .venv/bin/python -m scripts.perf.figures --quick    # world sizes 1, 2, 4 and fewer message sizes

Each notebook runs the lessons itself (scripts/perf/sweep.py, one torchrun launch per world size) and
writes its figures as PNG files into docs/figures/. The executed notebooks, outputs included, are
written back into notebooks/ so they read with their figures on GitHub. The two notebooks share
one fresh set of runs (a cache directory that lives for this command only).
"""
import os
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient

from scripts.runs import ROOT, Parser

NOTEBOOKS = ["memory.ipynb", "comm_volume.ipynb", "at_scale.ipynb"]


def execute(path, env, write_back=True, timeout=1200):
    """Run a notebook top to bottom in a fresh kernel (cwd = its folder); raise on any error."""
    nb = nbformat.read(path, as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if write_back:
        nbformat.write(nb, path)
    return nb


def main():
    p = Parser("figures", description=__doc__)
    p.add_argument("--quick", action="store_true", help="world sizes 1, 2, 4; three message sizes")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "figures"), help="where the PNG files go")
    p.add_argument("--no-write-back", action="store_true", help="leave the notebooks' saved outputs alone")
    a = p.parse_args()
    p.folder("--out", a.out)
    with tempfile.TemporaryDirectory() as cache:
        env = {"FIGURES_DIR": os.path.abspath(a.out), "NOTEBOOK_CACHE": cache,
               "NOTEBOOK_QUICK": "1" if a.quick else "0", "OMP_NUM_THREADS": "1",
               "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
        for name in NOTEBOOKS:
            t0 = time.time()
            print(f"executing notebooks/{name} ...", flush=True)
            execute(os.path.join(ROOT, "notebooks", name), env, write_back=not a.no_write_back)
            print(f"  done in {time.time() - t0:.0f} s", flush=True)
    pngs = sorted(f for f in os.listdir(a.out) if f.endswith(".png"))
    print(f"figures in {os.path.relpath(a.out, ROOT)}/: {', '.join(pngs)}")


if __name__ == "__main__":
    sys.exit(main())
