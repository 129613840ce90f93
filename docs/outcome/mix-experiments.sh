#!/usr/bin/env bash
# Reduced-scale mix experiments (docs/outcome/experiments.md), judged on DEV data only (train seed 1, dev seed 11;
# never the outcome's held-out seeds nor data/transfer). Usage:
#   docs/outcome/mix-experiments.sh data                      # dev documents (2k tokens)
#   docs/outcome/mix-experiments.sh train NAME 'MIX_YAML' STEPS [recipe overrides...]
#   docs/outcome/mix-experiments.sh eval NAME                 # base (once, cached in runs/exp/base-eval) vs NAME
#   docs/outcome/mix-experiments.sh run NAME 'MIX_YAML' STEPS  # train, then eval
# e.g. docs/outcome/mix-experiments.sh run e0-answers '[{source: qa, path: runs/data/dev-train-2k.jsonl}]' 12
# The evaluation runs at cp=1 with ONE thread: on a machine shared by many jobs, starved threads and CP ranks wait on each other at every
# decoding step (cp=2 decoding took ~2 min per question at load 28; the numbers are the same, CP is exact).
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1  # one thread per process: see the eval note above
PY=.venv/bin/python
D=runs/data
EVAL_ARGS=(--cp 1 --tasks qa,needle,position-loss --data $D/dev-heldout-2k-s11.jsonl --max-new-tokens 16
           --lengths 1k,2k --depths 0,0.5,1 --repeats 2 --seed 11)
train() {
  name=$1 mix=$2 steps=$3; shift 3
  out=runs/exp/$name
  mkdir -p $out
  cat > $out/recipe.yaml <<YAML
output_dir: $out
parallelism: {cp_size: 2}
model: {name: SmolLM2-135M-Instruct}
lora: {enabled: true, r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]}
data: {seq_len: 2048, mix: $mix}
optim: {lr: 5.0e-4, warmup_steps: 2, decay: cosine, min_lr_ratio: 0.1, max_grad_norm: 1.0}
train: {steps: $steps, batch_size: 1, mixed_precision: auto, loss_chunk_tokens: 1024}
checkpoint: {every: 0, at_end: false, export: true}
log: {progress: false}
YAML
  t0=$(date +%s)
  .venv/bin/accelerate launch --config_file recipes/accelerate/cpu-2proc.yaml -m longdoc train $out/recipe.yaml \
      overwrite=true "$@" > $out/train.log 2>&1
  echo "$name: train $(( $(date +%s) - t0 )) s" | tee -a runs/exp/times.txt
}
evaluate() {
  name=$1 out=runs/exp/$1
  t0=$(date +%s)
  if [ ! -d runs/exp/base-eval ]; then
    $PY -m longdoc eval compare SmolLM2-135M-Instruct $out/final --names base tuned "${EVAL_ARGS[@]}" \
        --out $out/compare > $out/eval.log 2>&1
    cp -r $out/compare/base runs/exp/base-eval
  else
    $PY -m longdoc eval compare runs/exp/base-eval $out/final --names base tuned "${EVAL_ARGS[@]}" \
        --out $out/compare > $out/eval.log 2>&1
  fi
  echo "$name: eval $(( $(date +%s) - t0 )) s" | tee -a runs/exp/times.txt
  $PY docs/outcome/summarize.py $out/compare | tee -a runs/exp/rows.md
}
# One model alone, each task its own run folder (runs/exp/NAME/eval/<task>); compare folders afterwards with
#   .venv/bin/python -m longdoc eval compare runs/exp/base-eval runs/exp/NAME/eval --out runs/exp/NAME/compare
evaluate_alone() {
  name=$1 model=${2:-runs/exp/$1/final} out=runs/exp/$1/eval
  t0=$(date +%s)
  mkdir -p $out
  $PY -m longdoc eval qa --model $model --cp 1 --data $D/dev-heldout-2k-s11.jsonl --max-new-tokens 16 \
      --out $out/qa > runs/exp/$1/eval-qa.log 2>&1
  $PY -m longdoc eval needle --model $model --cp 1 --lengths 1k,2k --depths 0,0.5,1 --repeats 2 --seed 11 \
      --max-new-tokens 16 --out $out/needle > runs/exp/$1/eval-needle.log 2>&1
  $PY -m longdoc eval position-loss --model $model --cp 1 --data $D/dev-heldout-2k-s11.jsonl \
      --out $out/position-loss > runs/exp/$1/eval-pl.log 2>&1
  echo "$name: eval alone $(( $(date +%s) - t0 )) s" | tee -a runs/exp/times.txt
}
case "$1" in
alone) evaluate_alone "$2" "${3:-}" ;;
data)
  mkdir -p $D
  $PY -m longdoc data synth --domain legal --num-docs 8 --tokens 2048 --seed 1 --out $D/dev-train-2k.jsonl
  $PY -m longdoc data synth --domain legal --num-docs 4 --tokens 2048 --seed 11 --out $D/dev-heldout-2k-s11.jsonl
  ;;
train) shift; train "$@" ;;
eval) evaluate "$2" ;;
run) shift; train "$@"; evaluate "$1" ;;
esac
