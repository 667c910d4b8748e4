# make install | smoke | smoke-gpu [PART=train|eval|chain] | test | test-fast | lint | vendor-check | validate CKPT=... | preflight STUDENT=... TEACHER=... | vendor
# make checkpoints RUN=... [VERIFY=1]   (a run folder's trainer states: step, complete, export validation)
# make patch [BASE=ref] [PATCH_FILE=opd.patch] | patch-check [BASE=ref]   (the submission patch)
# make data SRC=... [OUT=...] | data-eval EVAL_SETS=... | eval MODEL=... SUITE=math500|aime|embedded [OUT=...] | plot RUN=...   (data, evaluation)
# make select RUN=... [STUDENT=...] [SELECT_ARGS=...]   (a run's checkpoint: its kept exports ranked on math500, the choice scored on aime)
# make run STUDENT=... TEACHER=... DAPO=... [DEADLINE=...|WALL_CLOCK=...] [STAGE=...] | run TASK=addition   (the real run, one command)
# make bench [PHASE=kernels|teacher|step|layout|save|decode|lastsave] [SIZE=full|cpu] [OUT=bench.json] | bench-cpu-kernels | bench-logprob   (performance)
# make learn [SEEDS=N] [DEVICE=gpu] [OUT=outputs/learn]   (proof of learning: the known-answer task, every recipe)
# make study SPEC=recipes/studies/....yaml [OUT=...] [STUDY_ARGS=...] | arms CONTROL=k1 TREATMENT=topk   (studies)
# make wheelhouse PROFILE=gpu|cpu [DIR=...] [TORCH_FROM=...] | install WHEELHOUSE=DIR   (installs without network)
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

.PHONY: run learn install smoke smoke-gpu test test-fast lint vendor-check vendor validate preflight patch patch-check data data-eval eval select plot bench bench-cpu-kernels bench-logprob checkpoints study arms

install: $(DEPS)
	@$(PY) tools/patch.py record-base   # tags the commit you start from as opd-base, once

$(VENV)/.installed-%: requirements/%.txt pyproject.toml verl_vendor/pin.toml
ifeq ($(WHEELHOUSE),)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/$*.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) verl_vendor/vendor.py check
else
	python3 tools/wheelhouse.py install --profile $* --dir $(WHEELHOUSE) --venv $(VENV)
endif
	@$(PY) tools/patch.py record-base   # also when smoke/test/... install implicitly: make patch needs it
	@rm -f $(VENV)/.installed-*
	@touch $@

# Every wheel of a profile for its target (gpu: Linux x86_64 glibc >= 2.35, CPython 3.12; cpu: this
# machine), resolved at requirements/uv.toml's date, sdist-only pure-Python packages built into wheels.
# Copy DIR to the offline host, then `make install WHEELHOUSE=DIR` there (tools/wheelhouse.py).
.PHONY: wheelhouse
wheelhouse:
	python3 tools/wheelhouse.py build --profile $(PROFILE) --dir $(or $(DIR),.cache/wheelhouse-$(PROFILE))$(if $(TORCH_FROM), --torch-from $(TORCH_FROM))

smoke: $(DEPS)
	$(PY) -m tools.smoke --timeout $(SMOKE_TIMEOUT)

# Opt-in GPU smoke (tools/smoke_gpu.py): vLLM rollout + colocated teacher + FSDP update, 2 steps of
# topk at the R1-Distill-1.5B architecture (random weights), one save, the export evaluated by vLLM.
# PART=train|eval runs one half (two 10-minute windows); SMOKE_GPU_ARGS e.g. "--recipe k1 --limit 8".
smoke-gpu: $(DEPS)
	$(PY) -m tools.smoke_gpu $(if $(PART),--part $(PART)) $(if $(OUT),--out $(OUT)) $(SMOKE_GPU_ARGS)

# End-to-end runs start in the background after collection (tests/background.py; OPD_TEST_JOBS slots).
# Bytecode is cached even where PYTHONDONTWRITEBYTECODE is set (as on this project's machines): otherwise
# each Python process of the suite (every Ray worker of every training) compiles opd_patches again
# (~0.7 s each here) and pytest rewrites every test module's asserts again (~6 s per session).
test: $(DEPS)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q --durations=20

# The quick loop: no end-to-end run, no fresh process importing VERL (both run in `make test`).
test-fast: $(DEPS)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m "not slow and not fresh_process" --durations=10

# No machine names, dates, commit hashes, issue numbers or measured figures in comments (tools/lint_history.py);
# the import map: no circle, nothing in the runtime imports tools/, training imports no eval/study/data (tools/lint_imports.py).
lint:
	python3 tools/lint_history.py
	python3 tools/lint_imports.py

vendor-check: $(DEPS)
	$(PY) verl_vendor/vendor.py check

vendor:
	python3 verl_vendor/vendor.py materialize

# CKPT: an export (.../actor/huggingface), a state (global_step_N) or a run folder (its newest complete state).
# VALIDATE_ARGS e.g. "--expected-from deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B --dtype float32".
validate: $(DEPS)
	@test -n "$(CKPT)" || { echo "usage: make validate CKPT=<run folder | run/global_step_N | .../actor/huggingface> [VALIDATE_ARGS=...]"; exit 2; }
	$(PY) -m opd_patches.ops.validate $(CKPT) $(VALIDATE_ARGS)

# The trainer states of a run folder: step, complete (receipt), export validation (opd_patches/ops/checkpoints.py).
# VERIFY=1: also re-hash every file against its receipt's sha256 (reads every state whole), as a resume does.
checkpoints: $(DEPS)
	@test -n "$(RUN)" || { echo "usage: make checkpoints RUN=<run folder> [VERIFY=1]"; exit 2; }
	$(PY) -m opd_patches.ops.checkpoints list $(RUN)$(if $(filter 1,$(VERIFY)), --verify)

# Student/teacher compatibility report: vocabulary, chat template, step-0 overlap statistics.
# Exit status 2 on a mismatch. DATA (a VERL parquet) gives real prompts; PREFLIGHT_ARGS for more flags.
PREFLIGHT_OUT ?= preflight.json
preflight: $(DEPS)
	@test -n "$(STUDENT)" -a -n "$(TEACHER)" || { echo "usage: make preflight STUDENT=<model> TEACHER=<model> [DATA=train.parquet] [PREFLIGHT_OUT=preflight.json]"; exit 2; }
	$(PY) -m opd_patches.checks.preflight --student $(STUDENT) --teacher $(TEACHER) $(if $(DATA),--data $(DATA)) --out $(PREFLIGHT_OUT) $(PREFLIGHT_ARGS)

# The submission patch: the editable surface (opd_patches recipes run.sh Makefile README.md docs tests tools),
# untracked files included, diffed against BASE (default: the tag opd-base that `make install` made).
# patch-check rewrites it, applies it to a clean checkout of the base and runs the vendor check.
# (tools/patch.py is run as a script, = python -m tools.patch without importing verl.)
PATCH_FILE ?= opd.patch
patch: $(DEPS)
	$(PY) tools/patch.py write $(if $(BASE),--base $(BASE)) --out $(PATCH_FILE)

patch-check: patch
	$(PY) tools/patch.py check $(if $(BASE),--base $(BASE)) --patch $(PATCH_FILE)

# Training data: DAPO-style or {problem, answer} rows -> VERL parquet, de-duplicated, decontaminated
# against the evaluation sets (opd_patches/data/prepare.py). DATA_ARGS e.g. "--val-size 256 --eval-sets DIR".
data: $(DEPS)
	@test -n "$(SRC)" || { echo "usage: make data SRC=<file.parquet|.jsonl> [OUT=$$HOME/data/dapo-math] [DATA_ARGS=...]"; exit 2; }
	$(PY) -m opd_patches.data $(SRC) $(if $(OUT),--out $(OUT)) $(DATA_ARGS)

# The evaluation data folder ($OPD_EVAL_DATA, else ~/data/opd-eval): NAME=SOURCE pairs, a SOURCE being a
# local file or a Hugging Face dataset owner/name[:split] (opd_patches/data/eval_sets.py).
data-eval: $(DEPS)
	@test -n "$(EVAL_SETS)" || { echo "usage: make data-eval EVAL_SETS=\"math500=HuggingFaceH4/MATH-500:test aime24=... aime25=...\" [OUT=dir]"; exit 2; }
	$(PY) -m opd_patches.data.eval_sets $(EVAL_SETS) $(if $(OUT),--out $(OUT))

# Evaluation of one model on one suite (opd_patches/eval/): generations.jsonl, summary.json, scores.png.
# EVAL_ARGS e.g. "--limit 50 --samples 2 --data-dir DIR --backend hf --verifier JUDGE".
eval: $(DEPS)
	@test -n "$(MODEL)" -a -n "$(SUITE)" || { echo "usage: make eval MODEL=<hf folder> SUITE=math500|aime|embedded|<protocol.yaml> [OUT=dir] [EVAL_ARGS=...]"; exit 2; }
	$(PY) -m opd_patches.eval --model $(MODEL) --suite $(SUITE) $(if $(OUT),--out $(OUT)) $(EVAL_ARGS)

# Checkpoint selection of one run (opd_patches/study/select.py): every kept, validated export on the proxy suite
# (math500), the best (within one paired SE of it: the latest step) on the final suite (aime), the student on both
# (cached by the digest of its files, shared by every run) -> RUN/select/selection.md, selection.json, evals/.
# Resumable: the same command reuses finished evaluations. SELECT_ARGS e.g. "--samples 2 --limit 50 --backend hf".
select: $(DEPS)
	@test -n "$(RUN)" || { echo "usage: make select RUN=<run folder> [STUDENT=<model>] [SELECT_ARGS=\"--proxy math500 --final aime\"]"; exit 2; }
	$(PY) -m opd_patches.study.select $(RUN) $(if $(STUDENT),--student $(STUDENT)) $(SELECT_ARGS)

# The real run in one resumable command (opd_patches/study/chain.py, docs/run.md): evaluation sets, training data
# (decontaminated), pre-flight, training (RECIPE, default topk; stopped in time for selection and the final score
# before DEADLINE, an absolute time, or WALL_CLOCK seconds from the first launch), selection, final score,
# OUT/report.md (OUT default outputs/run). STAGE=data-eval|data|preflight|train|select|final|report runs one.
# TASK=addition: the known-answer task, every stage on a CPU (OUT default outputs/run-addition). The same command
# continues after a crash or a kill; other inputs in the same OUT are refused. OVERRIDES: Hydra overrides of the
# training; EVAL_SETS as make data-eval; SELECT_ARGS as make select (e.g. "--samples 2 --backend hf");
# RUN_ARGS e.g. --new-deadline (replace the deadline fixed at the first launch).
run: $(DEPS)
	$(PY) -m opd_patches.study.chain $(if $(TASK),--task $(TASK)) $(if $(STUDENT),--student $(STUDENT)) \
	  $(if $(TEACHER),--teacher $(TEACHER)) $(if $(DAPO),--dapo $(DAPO)) $(if $(RECIPE),--recipe $(RECIPE)) \
	  $(if $(DEADLINE),--deadline $(DEADLINE)) $(if $(WALL_CLOCK),--wall-clock $(WALL_CLOCK)) $(if $(OUT),--out $(OUT)) \
	  $(if $(STAGE),--stage $(STAGE)) $(if $(EVAL_SETS),--eval-sets "$(EVAL_SETS)") $(if $(EVAL_DATA),--eval-data $(EVAL_DATA)) \
	  $(if $(SELECT_ARGS),"--select-args=$(SELECT_ARGS)") $(if $(filter 1,$(FORCE)),--force) $(RUN_ARGS) $(OVERRIDES)

# Plots of a run folder: evaluated checkpoints' scores (make select's and make eval's, if any) and training curves -> RUN/plots/.
plot: $(DEPS)
	@test -n "$(RUN)" || { echo "usage: make plot RUN=<run folder>"; exit 2; }
	@mkdir -p $(RUN)/plots
	@if ls $(RUN)/select/evals/*/*/summary.json $(RUN)/global_step_*/eval/*/summary.json 2>/dev/null | grep -q .; then $(PY) -m opd_patches.eval.plot $(RUN) --out $(RUN)/plots/scores.png; fi
	$(PY) -m opd_patches.eval.plot --curves $(RUN)/metrics.jsonl --out $(RUN)/plots/training_curves.png

# Performance phases (tools/bench/): each real code path next to its plain-PyTorch reference,
# peak GPU memory per measurement; phases merge into one JSON. SIZE=full needs a CUDA GPU (1.5B
# architecture, 32 x 5,200 tokens); SIZE=cpu is a quick check. BENCH_ARGS e.g. "--variants lean_topk_tail --no-model".
# PHASE=step: two training steps of RECIPE through run.sh (ROLLOUT=vllm|hf), VERL's timing_s/* per step;
# RECIPE="k1 topk" GPUS="0 1" runs both at once, one GPU each. LENGTHS=seed-math500 (or cap@2,seed-math500@2:
# two steps at the cap, then the profile) gives each response a length from a documented profile
# (opd_patches/hooks/lengths.py; random weights otherwise run every response to the cap).
PHASE ?= kernels
bench: $(DEPS)
	$(PY) -m tools.bench --phase $(PHASE) $(if $(SIZE),--size $(SIZE)) --out $(or $(OUT),bench.json) \
	  $(if $(RECIPE),--recipe $(RECIPE)) $(if $(GPUS),--gpus $(GPUS)) $(if $(ROLLOUT),--rollout $(ROLLOUT)) $(if $(LENGTHS),--lengths $(LENGTHS)) $(BENCH_ARGS)

# CPU regression benchmark of the loss kernels (JSON for comparisons between commits on one machine).
bench-cpu-kernels: $(DEPS)
	$(PY) -m tools.bench.cpu_kernels --out $(or $(OUT),outputs/bench/cpu_kernels.json)

# Sampled-token log-prob fwd+bwd, upstream's fallback vs the patched kernel vs naive (about a minute of
# GPU time at 15,600 x 151,936 bf16; a reduced size on the CPU). BENCH_ARGS e.g. "--tokens 4096".
bench-logprob: $(DEPS)
	$(PY) -m tools.bench.logprob $(if $(OUT),--out $(OUT)) $(BENCH_ARGS)

# Studies (opd_patches/study/): every (arm, seed) of a spec trained via run.sh under one run lock, the chosen
# checkpoints evaluated, report.md/.json/.png written into OUT (default outputs/studies/<name>). Resumable:
# the same command skips complete runs and evaluations. STUDY_ARGS e.g. "--dry-run", "--report-only", "--force".
study: $(DEPS)
	@test -n "$(SPEC)" || { echo "usage: make study SPEC=recipes/studies/<spec>.yaml [OUT=dir] [STUDY_ARGS=--dry-run]"; exit 2; }
	$(PY) -m opd_patches.study $(SPEC) $(if $(OUT),--out $(OUT)) $(if $(filter 1,$(FORCE)),--force) $(STUDY_ARGS)

# Proof of learning (recipes/studies/learn.yaml): builds the known-answer task once (.cache/addition, a few
# minutes), trains k1, topk and topk_tail from its student, evaluates student, teacher and the exports, and
# prints the table of outputs/learn/summary.json. SEEDS=N: seeds 1..N per arm. DEVICE=gpu: topk on the vLLM
# rollout, its last export evaluated by vLLM (recipes/studies/learn-gpu.yaml, into outputs/learn-gpu).
LEARN_SPEC = $(if $(filter gpu,$(DEVICE)),learn-gpu,learn)
learn: $(DEPS)
	$(PY) -m opd_patches.embedded --task addition --out .cache/addition
	$(PY) -m opd_patches.study recipes/studies/$(LEARN_SPEC).yaml --out $(or $(OUT),outputs/$(LEARN_SPEC)) $(if $(SEEDS),--seeds $(SEEDS)) $(STUDY_ARGS)

# Ablation arms: the knobs that differ between two recipes and the one-knob-at-a-time arms (no training).
arms: $(DEPS)
	@test -n "$(CONTROL)" -a -n "$(TREATMENT)" || { echo "usage: make arms CONTROL=k1 TREATMENT=topk"; exit 2; }
	$(PY) -m opd_patches.study.arms --control $(CONTROL) --treatment $(TREATMENT)
