#!/usr/bin/env bash
# One launcher for every recipe:   ./run.sh [recipe=NAME] [any Hydra override...]
#   ./run.sh recipe=topk data.train_batch_size=8 trainer.total_training_steps=100
# Paths and choices below come from the environment (STUDENT=... ./run.sh ...); Hydra overrides
# given on the command line are applied last and win.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# EMBEDDED brings its own models and prompts: a STUDENT, TEACHER or data file set beside it would be ignored.
if [[ "${EMBEDDED:-0}" != 0 ]]; then
  given=()
  for v in STUDENT TEACHER TRAIN_FILES VAL_FILES; do if [[ -n "${!v:-}" ]]; then given+=("$v"); fi; done
  if (( ${#given[@]} )); then
    echo "run.sh: EMBEDDED=$EMBEDDED uses its built-in models and prompts, but ${given[*]} is also set and would be" \
         "ignored: unset ${given[*]}, or leave EMBEDDED out to train on them" >&2
    exit 2
  fi
fi

# ---- defaults --------------------------------------------------------------------------------
RECIPE=${RECIPE:-k1}
DEVICE=${DEVICE:-auto}          # cpu | gpu (vLLM rollout) | gpu-hf (HF rollout on CUDA) | auto
EMBEDDED=${EMBEDDED:-0}         # 1: tiny random student + teacher (make smoke); addition: the known-answer task (make learn)
STUDENT=${STUDENT:-deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B}
TEACHER=${TEACHER:-hbx/JustRL-DeepSeek-1.5B}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/dapo-math/train.parquet}
VAL_FILES=${VAL_FILES:-$TRAIN_FILES}
N_GPUS=${N_GPUS:-1}             # actor (and rollout) GPUs per node
OUTPUT_DIR=${OUTPUT_DIR:-}      # default: outputs/<recipe>
PYTHON=${PYTHON:-}              # default: the project's .venv, else python3 (a prepared environment)
FORCE=${FORCE:-0}               # 1: start despite a held run lock, a busy GPU or too little disk/memory (opd.force=true)
WALL_CLOCK=${WALL_CLOCK:-}      # seconds from launch; the trainer stops in time to save (opd.wall_clock_s)
RESERVE=${RESERVE:-}            # seconds kept free at the end of WALL_CLOCK (opd.reserve_s)

args=()
for a in "$@"; do
  case "$a" in
    recipe=*) RECIPE=${a#recipe=} ;;
    *) args+=("$a") ;;
  esac
done
OUTPUT_DIR=${OUTPUT_DIR:-$ROOT/outputs/$RECIPE}
if [[ -z "$PYTHON" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi

if [[ "$RECIPE" == base || ! -f "$ROOT/recipes/$RECIPE.yaml" ]]; then
  known=$(cd "$ROOT/recipes" && ls ./*.yaml | sed 's|^\./||; s|\.yaml$||' | grep -vx base | tr '\n' ' ')
  echo "run.sh: unknown recipe '$RECIPE'; choose one of: $known(recipes/README.md)" >&2
  exit 2
fi

if [[ "$DEVICE" == auto ]]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    if "$PYTHON" -c 'import vllm' >/dev/null 2>&1; then DEVICE=gpu; else DEVICE=gpu-hf; fi
  else
    DEVICE=cpu
  fi
fi
[[ -f "$ROOT/recipes/device/$DEVICE.yaml" ]] || { echo "run.sh: DEVICE=$DEVICE: use cpu, gpu, gpu-hf or auto" >&2; exit 2; }
if [[ "$DEVICE" == cpu ]]; then export VERL_PLATFORM=cpu; fi

case "$EMBEDDED" in
  0|"") ;;
  1|addition)
    if [[ "$EMBEDDED" == 1 ]]; then EMB="$ROOT/.cache/embedded" TASK=default; else EMB="$ROOT/.cache/$EMBEDDED" TASK=$EMBEDDED; fi
    "$PYTHON" -m opd_patches.embedded --task "$TASK" --out "$EMB"
    STUDENT=$EMB/student TEACHER=$EMB/teacher TRAIN_FILES=$EMB/data/train.parquet VAL_FILES=$EMB/data/val.parquet ;;
  *) echo "run.sh: EMBEDDED=$EMBEDDED: use 1 (tiny random models) or addition (the known-answer task)" >&2; exit 2 ;;
esac

export VERL_USE_EXTERNAL_MODULES=opd_patches.registered   # every process that imports verl registers our hooks
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

# ---- overrides, grouped ------------------------------------------------------------------------
models=(
  actor_rollout_ref.model.path="$STUDENT"
  distillation.teacher_models.teacher_model.model_path="$TEACHER"
)
data=(
  data.train_files="$TRAIN_FILES"
  data.val_files="$VAL_FILES"
)
placement=(
  +device="$DEVICE"
  trainer.n_gpus_per_node="$N_GPUS"
)
output=(
  trainer.default_local_dir="$OUTPUT_DIR"
)
if [[ -n "$WALL_CLOCK" ]]; then output+=(opd.wall_clock_s="$WALL_CLOCK"); fi
if [[ -n "$RESERVE" ]]; then output+=(opd.reserve_s="$RESERVE"); fi
checks=()
if [[ "$FORCE" == 1 ]]; then checks+=(opd.force=true); fi
recipe=(
  --config-path "$ROOT/recipes" --config-name "$RECIPE"
  "hydra.searchpath=[pkg://verl.trainer.config]"   # recipes are deltas over VERL's ppo_trainer
)

exec "$PYTHON" -m opd_patches.main "${recipe[@]}" \
  "${models[@]}" "${data[@]}" "${placement[@]}" "${output[@]}" "${checks[@]}" "${args[@]}"
