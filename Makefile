# make install | smoke | test | test-fast | vendor-check | validate CKPT=... | preflight STUDENT=... TEACHER=... | vendor
# PROFILE=cpu|gpu picks the dependency set (default: gpu when nvidia-smi sees a GPU).
# PREPARED=1 uses the python3 already on PATH and installs nothing (e.g. an offline GPU host
# where the packages were staged beforehand).
SHELL := /bin/bash
PROFILE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
VENV ?= .venv
PREPARED ?= 0
SMOKE_TIMEOUT ?= 300

ifeq ($(PREPARED),1)
PY := python3
DEPS :=
else
PY := $(VENV)/bin/python
DEPS := $(VENV)/.installed-$(PROFILE)
endif

.PHONY: install smoke test test-fast vendor-check vendor validate preflight

install: $(DEPS)

$(VENV)/.installed-%: requirements/%.txt pyproject.toml verl_vendor/pin.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/$*.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) verl_vendor/vendor.py check
	@rm -f $(VENV)/.installed-*
	@touch $@

smoke: $(DEPS)
	$(PY) -m opd_patches.smoke --timeout $(SMOKE_TIMEOUT)

test: $(DEPS)
	$(PY) -m pytest -q

test-fast: $(DEPS)
	$(PY) -m pytest -q -m "not slow"

vendor-check: $(DEPS)
	$(PY) verl_vendor/vendor.py check

vendor:
	python3 verl_vendor/vendor.py materialize

validate: $(DEPS)
	@test -n "$(CKPT)" || { echo "usage: make validate CKPT=<run>/global_step_N/actor/huggingface"; exit 2; }
	$(PY) -m opd_patches.validate $(CKPT)

# Student/teacher compatibility report: vocabulary, chat template, step-0 overlap statistics.
# Exit status 2 on a mismatch. DATA (a VERL parquet) gives real prompts; PREFLIGHT_ARGS for more flags.
PREFLIGHT_OUT ?= preflight.json
preflight: $(DEPS)
	@test -n "$(STUDENT)" -a -n "$(TEACHER)" || { echo "usage: make preflight STUDENT=<model> TEACHER=<model> [DATA=train.parquet] [PREFLIGHT_OUT=preflight.json]"; exit 2; }
	$(PY) -m opd_patches.preflight --student $(STUDENT) --teacher $(TEACHER) $(if $(DATA),--data $(DATA)) --out $(PREFLIGHT_OUT) $(PREFLIGHT_ARGS)
