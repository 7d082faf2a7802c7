# Two commands do all set-up on a fresh machine with only Python:
#   make train   plan and train the main job (writes runs/...)
#   make test    run the whole test suite
# Both create .venv if missing and install torch==2.13.0 (the CPU wheel) before the project, so pip
# never resolves torch from a loose range (which would pull gigabytes of CUDA packages).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.autoshard-installed

.PHONY: test train install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,fast]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

train: $(STAMP)
	@echo "autoshard's distributed training is not built yet: running the single-device reference trainer."
	$(PY) -m models.train_single --model llama3-tiny --steps 50

clean:
	rm -rf $(VENV) *.egg-info
