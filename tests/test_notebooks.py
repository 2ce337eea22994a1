"""Both notebooks run headless from start to finish, as `make figures` runs them, and draw their
figures. The notebooks assert what they show (every lesson's memory and communication against
the ZeRO paper, gloo's wire bytes), so a wrong number fails here as an error in a cell.

Quick mode (NOTEBOOK_QUICK=1): world sizes 1, 2 and 4, three message sizes for the bandwidth;
one torchrun launch for all world sizes, shared by the two notebooks.
"""
import os

import nbformat  # noqa: F401  (a clear ImportError here if the notebook tools are missing)

from harness import ROOT
from scripts.perf.figures import execute

FIGURES = {"memory.ipynb": ["memory_per_rank", "memory_offload_tiers", "memory_activations", "zero3_params_timeline", "muon_per_rank", "figure1_simulated",
                           "zero_calculator"],
           "comm_volume.ipynb": ["comm_per_step", "ring_reduce_scatter", "bandwidth"],
           "at_scale.ipynb": ["at_scale_memory", "at_scale", "at_scale_crossover", "at_scale_largest", "at_scale_hsdp"]}


def test_notebooks_run_headless_and_draw_their_figures(tmp_path):
    env = {"NOTEBOOK_QUICK": "1", "FIGURES_DIR": str(tmp_path / "figures"),
           "NOTEBOOK_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    for name, figures in FIGURES.items():
        # raises CellExecutionError, with the failing cell and its traceback, on any error
        nb = execute(os.path.join(ROOT, "notebooks", name), env, write_back=False, timeout=300)
        images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if "image/png" in o.get("data", {})]
        assert len(images) == len(figures), name  # every figure shown inline too
        for figure in figures:
            path = tmp_path / "figures" / f"{figure}.png"
            assert path.stat().st_size > 20_000, path  # a real plot, not an empty canvas
