# Two commands do all set-up on a fresh machine with only Python:
#   make train   plan and train llama3-debug on a 2x2 CPU mesh under torchrun (writes runs/debug)
#   make test    run the whole test suite
# (make test-fast: the inner loop, under 5 minutes on 2 cores: no torchrun launches, no slow cases)
# (make test-torch-next and make test-torch-2.11 run a representative part of the suite on the
# newest and the oldest torch we support, each in its own venv, .venv-next and .venv-2.11; .ci/run
# runs all three)
# (make bench runs the planning benchmarks and training throughput, ~35 min: benchmarks/README.md)
# (make lint: ruff's lint and format check on everything, mypy on solver/ and autoshard/driver/)
# Both create .venv if missing and install torch==2.13.0 (the CPU wheel) before the project, so pip
# never resolves torch from a loose range (which would pull gigabytes of CUDA packages).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autoshard-installed

# The newest supported torch (a CUDA wheel, ~3 GB with its nvidia packages, that runs on CPU), in a
# second venv; the project installs into it without touching torch (its range admits both).
TORCH_NEXT ?= 2.14.1
VENV_NEXT ?= .venv-next
PY_NEXT := $(VENV_NEXT)/bin/python
STAMP_NEXT := $(VENV_NEXT)/.autoshard-installed
# their fast cases, and one slow case of each kind that differs across torch releases: sharded HF
# numerics, a dry run at 8B scale, bf16 under torchrun with a checkpoint and resume, the compiled
# program under torchrun, pipeline stages under torch's schedules (all of them run on 2.13 in `make test`)
NEXT_TESTS := tests/test_layers.py tests/test_trace.py tests/test_apply.py tests/test_hf.py tests/test_dryrun.py \
	tests/test_precision.py tests/test_compile.py tests/test_random.py tests/test_strategies.py tests/test_losses.py \
	tests/test_pipeline_run.py tests/test_experts.py
NEXT_SLOW := 'tests/test_hf.py::test_hf_causal_lm_trains_like_single_device[llama-mesh_shape0-False]' \
	'tests/test_dryrun.py::test_dry_runs_at_scale[llama3-8b-8x8]' \
	tests/test_precision.py::test_torchrun_bf16_trains_checkpoints_and_resumes \
	tests/test_compile.py::test_torchrun_compiled_program_trains_like_the_uncompiled_one \
	tests/test_pipeline_run.py::test_pipelines_train_as_one_device_does

# The oldest supported torch (also a CUDA wheel that runs on CPU; the GPU machines' own release), in
# a third venv, tested on the same subset.
TORCH_OLD ?= 2.11.0
VENV_OLD ?= .venv-2.11
STAMP_OLD := $(VENV_OLD)/.autoshard-installed

# $(call torch_venv,VENV,TORCH): a venv with torch==TORCH, then the project without touching torch
# (no pip cache: a CUDA wheel and its nvidia packages would take their gigabytes twice on disk).
define torch_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --no-cache-dir torch==$(2)
	$(1)/bin/python -m pip install --quiet --no-cache-dir -e '.[test,fast,hf]'
	$(1)/bin/python -c "import torch; assert torch.__version__.startswith('$(2)'), torch.__version__"
	touch $(1)/.autoshard-installed
endef

.PHONY: test test-fast test-torch-next test-torch-2.11 train bench install browser clean lint

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,fast,hf,data,logging,wandb,lint,lora]'
	touch $(STAMP)

# Headless chromium for tests/test_report_html.py (renders report.html in a real browser; the test
# skips without it). Installed via apt when missing and we are root; never fails the set-up.
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
		(apt-get update -qq && apt-get install -y -qq chromium) || \
		echo "note: could not install chromium; the browser check of report.html will be skipped"

test: $(STAMP) browser
	$(PY) -m pytest

# the inner loop: no torchrun launches (`ranks`), no `slow` cases, no benchmark runs
FAST_SKIP := --ignore=tests/test_benchmarks.py --ignore=tests/test_gpu_check.py \
	--ignore=tests/test_overlap_bench.py --ignore=tests/test_text_learns.py
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not ranks" $(FAST_SKIP)

$(STAMP_NEXT): pyproject.toml
	$(call torch_venv,$(VENV_NEXT),$(TORCH_NEXT))

test-torch-next: $(STAMP_NEXT)
	$(PY_NEXT) -m pytest -m "not slow" $(NEXT_TESTS)
	$(PY_NEXT) -m pytest $(NEXT_SLOW)

$(STAMP_OLD): pyproject.toml
	$(call torch_venv,$(VENV_OLD),$(TORCH_OLD))

test-torch-2.11: $(STAMP_OLD)
	$(VENV_OLD)/bin/python -m pytest -m "not slow" $(NEXT_TESTS)
	$(VENV_OLD)/bin/python -m pytest $(NEXT_SLOW)

train: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=4 -m autoshard train \
		--model llama3-debug --mesh 2x2 --batch 8 --seq 64 --steps 30 --out runs/debug --overwrite
	@echo "sharding log: runs/debug/sharding.log   report: runs/debug/report.html   plan: runs/debug/plan.json   metrics: runs/debug/metrics.jsonl"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m benchmarks.suite.run

clean:
	rm -rf $(VENV) $(VENV_NEXT) $(VENV_OLD) *.egg-info
