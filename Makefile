# The two commands of the quick start. Each sets up .venv (pinned, torch first) when missing.
.PHONY: demo test bench scaling figures setup lecture diffs timelines
export OMP_NUM_THREADS ?= 1
export PYTHONWARNINGS ?= ignore::FutureWarning

setup:
	@bash scripts/setup.sh

demo: setup      ## run every lesson at 2 ranks on CPU and print one comparison table
	.venv/bin/python scripts/demo.py --nproc 2

test: setup      ## the whole test suite (CPU, gloo)
	.venv/bin/python -m pytest -q tests

bench: setup     ## every lesson against its PyTorch counterpart, interleaved: runs/bench/bench.{md,json,png}
	.venv/bin/python scripts/bench.py

scaling: setup   ## step time, bytes sent and held per rank vs model size (~1M-50M) and world size (1, 2, 4)
	.venv/bin/python scripts/scaling.py

figures: setup   ## regenerate the README's figures from fresh runs
	.venv/bin/python scripts/figures.py

lecture: setup   ## the lecture run: 01 -> 06 at 2 ranks in one launch, one table (about 2 minutes); FIGURES=1 also redraws the README's figures
	.venv/bin/python scripts/lecture.py $(if $(filter 1 yes true,$(FIGURES)),--figures)

diffs: setup     ## regenerate docs/diffs/ (the diff between consecutive lessons)
	.venv/bin/python scripts/diffs.py

timelines: setup ## one traced step per lesson: overlap table, docs/figures/timeline_*.png (about 2 minutes)
	.venv/bin/python scripts/timelines.py

.PHONY: student-edition grade
OUT ?= student
student-edition: setup ## the student edition: every lesson's solution regions cut out, into OUT (default student/)
	.venv/bin/python scripts/student_edition.py $(OUT)

grade: setup     ## grade a student edition: make grade EDITION=student (default: this checkout); points: tests/points.toml
	.venv/bin/python scripts/grade.py $(EDITION)
