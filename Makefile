# The two commands of the quick start. Each sets up .venv (pinned, torch first) when missing.
.PHONY: demo test bench figures setup lecture diffs timelines
export OMP_NUM_THREADS ?= 1
export PYTHONWARNINGS ?= ignore::FutureWarning

setup:
	@bash scripts/setup.sh

demo: setup      ## run every lesson at 2 ranks on CPU and print one comparison table
	.venv/bin/python scripts/demo.py --nproc 2

test: setup      ## the whole test suite (CPU, gloo)
	.venv/bin/python -m pytest -q tests

bench: setup     ## step time of 01-03 against PyTorch's DDP, interleaved, as a table
	.venv/bin/python scripts/bench.py

figures: setup   ## regenerate the README's figures from fresh runs
	.venv/bin/python scripts/figures.py

lecture: setup   ## the lecture run: 01 -> 06 at 2 ranks in one launch, one table (about 2 minutes)
	.venv/bin/python scripts/lecture.py

diffs: setup     ## regenerate docs/diffs/ (the diff between consecutive lessons)
	.venv/bin/python scripts/diffs.py

timelines: setup ## one traced step per lesson: overlap table, docs/figures/timeline_*.png (about 2 minutes)
	.venv/bin/python scripts/timelines.py
