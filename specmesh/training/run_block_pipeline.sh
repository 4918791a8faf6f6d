#!/bin/sh
# Background pipeline for the shipped block drafter (1 CPU thread throughout):
#   [wait for data generation] -> main run (causal injection, artefact) ->
#   ablation run without injection (same data, seed, LR schedule, stopped at the
#   snapshot step) -> MT-Bench acceptance eval of main, main@snapshot, ablation.
# Usage: sh specmesh/training/run_block_pipeline.sh [GEN_PID]   (from the repo root)
set -u
PY=${PY:-.venv/bin/python}
DATA=${DATA:-.cache/train/data}
ART=${ART:-artifacts/drafters/smollm2-135m-instruct-block}
ABL=${ABL:-.cache/train/ablation}
MAX_STEPS=${MAX_STEPS:-4000}
MAIN_MINUTES=${MAIN_MINUTES:-33}
SNAP=${SNAP:-1800}
ABL_MINUTES=${ABL_MINUTES:-16}

if [ $# -ge 1 ]; then
  while kill -0 "$1" 2>/dev/null; do sleep 15; done
  echo "[pipeline] data generation finished $(date -u +%H:%M:%S)"
fi
echo "[pipeline] main run start $(date -u +%H:%M:%S)"
$PY -m specmesh.training.train train --data "$DATA" --ckpt-dir .cache/train/ckpt/block \
  --export-dir "$ART" --max-steps "$MAX_STEPS" --cpu-budget-minutes "$MAIN_MINUTES" \
  --snapshot-step "$SNAP" --snapshot-dir "$ABL/injection-step$SNAP" --threads 1
echo "[pipeline] ablation run start $(date -u +%H:%M:%S)"
$PY -m specmesh.training.train train --data "$DATA" --ckpt-dir .cache/train/ckpt/block-noinj \
  --export-dir "$ABL/no-injection-step$SNAP" --no-causal-injection --max-steps "$MAX_STEPS" \
  --stop-at-step "$SNAP" --cpu-budget-minutes "$ABL_MINUTES" --threads 1
echo "[pipeline] eval start $(date -u +%H:%M:%S)"
$PY -m specmesh.training.train eval --data "$DATA" --threads 1 --out "$ART/eval_mtbench.json" \
  --drafter "$ART" "$ABL/injection-step$SNAP" "$ABL/no-injection-step$SNAP"
echo "[pipeline] done $(date -u +%H:%M:%S)"
