# The two commands of the quick start. Each sets up .venv (pinned, torch first) when missing.
# PYTHON=python3 make <target>: use that interpreter and its torch as they are, build no .venv
# (a GPU machine with torch preinstalled and no network).
.PHONY: help demo test bench scaling figures setup lecture diffs timelines gpu-check at-scale
.DEFAULT_GOAL := help
export OMP_NUM_THREADS ?= 1
export PYTHONWARNINGS ?= ignore::FutureWarning
PY := $(if $(PYTHON),$(PYTHON),.venv/bin/python)

help:            ## this list (plain `make` prints it)
	@grep -E '^[a-z0-9-]+:.*## ' $(firstword $(MAKEFILE_LIST)) | sed -E 's/^([a-z0-9-]+):[^#]*## /  make \1\t/' | expand -t 26

setup:           ## make .venv when it is missing (pinned, torch first; PYTHON=... uses that interpreter instead)
	@$(if $(PYTHON),true,bash scripts/setup.sh)

demo: setup      ## run every lesson at 2 ranks on CPU and print one comparison table
	$(PY) -m scripts.learn.demo --nproc 2

.PHONY: results
results: setup   ## write docs/results.md's CPU table (make demo's) from runs of this checkout; TIERS=1 also times the test tiers, GRADING=1 make grade; make gpu-check writes its GPU part
	$(PY) -m scripts.learn.results $(if $(filter 1 yes true,$(TIERS)),--tiers) $(if $(filter 1 yes true,$(GRADING)),--grading)

test: setup      ## the fast tier (CPU, gloo): every lesson at 1-3 ranks against one process and PyTorch; LESSON=05: that lesson's tests only
	LESSON=$(LESSON) $(PY) -m pytest -q tests -m "not slow"

.PHONY: test-all
test-all: setup  ## the slow tier: 4 ranks, the course kit, notebooks, tools, checkpoints, timing (.ci/run runs both tiers)
	$(PY) -m pytest -q tests -m slow

bench: setup     ## every lesson against its PyTorch counterpart, interleaved: runs/bench/bench.{md,json,png}
	$(PY) -m scripts.perf.bench

scaling: setup   ## step time, bytes sent and held per rank vs model size (~1M-50M) and world size (1, 2, 4)
	$(PY) -m scripts.perf.scaling

figures: setup   ## regenerate the README's figures from fresh runs
	$(PY) -m scripts.perf.figures

lecture: setup   ## the lecture run: 01 -> 08 at 2 ranks in one launch, one table (about 2 minutes); FIGURES=1 also redraws the README's figures; LINK=1:50 on a simulated link; HYBRID=1: 06 against 08 at 4 ranks on two simulated nodes (LINK inside, INTER between: 10:5 and 0.5:100 by default)
	$(PY) -m scripts.learn.lecture $(if $(filter 1 yes true,$(FIGURES)),--figures) $(if $(filter 1 yes true,$(HYBRID)),--hybrid) $(if $(LINK),--link $(LINK)) $(if $(INTER),--inter-link $(INTER))

at-scale: setup  ## the at-scale cost model: published checks, then calibrate on this machine (~1 minute): runs/at_scale/calibration.json
	$(PY) -m scripts.learn.at_scale --check-published && $(PY) -m scripts.learn.at_scale --calibrate

.PHONY: accumulation
accumulation: setup  ## 05-08 reducing at every micro-step or once a step, K = 1-8, 4 ranks; 08 on a slow link (~3 minutes): docs/results.md
	$(PY) -m scripts.perf.accumulation

.PHONY: muon-gaps
muon-gaps: setup ## why sharded Muon ends away from one process: ZeroRedundancyOptimizer, FSDP2 and 09 at 2 ranks, bf16 and fp32 Newton-Schulz (~3 minutes): docs/results.md
	$(PY) -m scripts.learn.muon_gaps

.PHONY: figure1
figure1: setup ## the ZeRO paper's Figure 1 measured: one rank of 64 (and 1024) simulated, 06 at 7.5B, 01/04/05 at 0.6B (~35 minutes): docs/results.md
	$(PY) -m scripts.learn.figure1

.PHONY: calibrate-link
calibrate-link: setup  ## the cost model against 01-06 on simulated 1 and 10 Gb/s links (~3 minutes): runs/at_scale/link_calibration.json; exit 1 beyond +-15%
	$(PY) -m scripts.learn.at_scale --calibrate --link 1:50 10:50

diffs: setup     ## regenerate docs/diffs/ (the diff between consecutive lessons)
	$(PY) -m scripts.learn.diffs

timelines: setup ## one traced step per lesson: overlap table, docs/figures/timeline_*.png (about 2 minutes)
	$(PY) -m scripts.perf.timelines

.PHONY: student-edition grade grade-class
OUT ?= student
LEVEL ?= guided
student-edition: setup ## the student edition: every lesson's solution regions cut out, into OUT (default student/); LEVEL=standard: goals only
	$(PY) -m scripts.course.student_edition $(OUT) --level $(LEVEL)

grade: setup     ## grade a student edition: make grade EDITION=student (default: this checkout); points: tests/points.toml
	$(PY) -m scripts.course.grade $(EDITION)

grade-class: setup ## grade a folder of submissions (directories, .zip, .tar.gz): make grade-class SUBMISSIONS=DIR -> grades.csv, grades.json (docs/course.md)
	$(if $(SUBMISSIONS),,$(error grade-class needs the folder of submissions: make grade-class SUBMISSIONS=DIR))
	$(PY) -m scripts.course.grade_class $(SUBMISSIONS) --out $(or $(GRADES),.)

gpu-check: setup ## on a machine with GPUs: every lesson on CUDA/nccl (00 at 2+ GPUs), fp32, bf16 (where the GPUs have it) and fp16, one table (runs/gpu_check/); exits 1 on a NaN, a short run or a loss off; no GPU: says so
	$(PY) -m scripts.perf.gpu_check --results

.PHONY: fuzz
fuzz: setup      ## the differential fuzzer: FUZZ_EXAMPLES cases (default 300) vs DDP/ZeRO/FSDP2 and one process; FUZZ_SEED=, FUZZ_SHRINK=1, FUZZ_LESSONS=04,05
	$(PY) -m tests.fuzz $(if $(FUZZ_EXAMPLES),--examples $(FUZZ_EXAMPLES)) $(if $(FUZZ_SEED),--seed $(FUZZ_SEED)) \
		$(if $(FUZZ_LESSONS),--lessons $(FUZZ_LESSONS)) $(if $(filter 1 yes true,$(FUZZ_SHRINK)),--shrink)
