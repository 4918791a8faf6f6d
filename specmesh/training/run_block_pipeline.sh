#!/bin/sh
# The block drafter for the default target, end to end on this CPU (every step resumable, cached
# under .cache/train; run from the repo root, in the background: nohup sh ... &).
#   1. data: ShareGPT prompts answered by the target (DATA_MINUTES), then ShareGPT's own replies
#      teacher-forced through the target (TEACHER_MINUTES);
#   2. training: TRAIN_MINUTES of CPU or MAX_STEPS steps, exporting to ART (checksummed);
#   3. the draft head's token ranking (ShareGPT frequencies; draft_worker.block.head_vocab);
#   4. offline MT-Bench acceptance of the export (generates the MT-Bench split first if needed).
# The shipped artefact's actual history (a warm-started chain of runs) is in its README.md.
set -u
SPECMESH=${SPECMESH:-".venv/bin/python -m specmesh.cli"}
DATA=${DATA:-.cache/train/data}
ART=${ART:-artifacts/drafters/smollm2-135m-instruct-block}
THREADS=${THREADS:-2}
DEVICE=${DEVICE:-auto}   # auto: cuda when torch sees a GPU (dtype auto then bf16); never run on a GPU here
$SPECMESH train-drafter --data "$DATA" --data-minutes "${DATA_MINUTES:-35}" \
  --teacher-minutes "${TEACHER_MINUTES:-25}" --threads "$THREADS" --device "$DEVICE" --ckpt-dir .cache/train/ckpt/block \
  --export-dir "$ART" --max-steps "${MAX_STEPS:-12000}" --cpu-budget-minutes "${TRAIN_MINUTES:-60}"
$SPECMESH drafter-vocab --export-dir "$ART"
$SPECMESH eval-drafter --data "$DATA" --threads "$THREADS" --device "$DEVICE" --drafter "$ART" --out "$ART/eval_mtbench.json"
