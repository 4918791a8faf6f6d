#!/usr/bin/env bash
# The model tier and the micro-bench on a CUDA GPU, in one run (docs/bench/engine.md, "On a GPU").
#
#   specmesh/bench/device_check.sh OUTDIR
#
# Run from the repository root on a machine whose python3 ($PY) has a CUDA build of torch and the
# project's other dependencies importable (PYTHONPATH will do), with the default model either
# converted already or its wheel in $SPECMESH_HOME/downloads: nothing is downloaded, so an offline
# GPU box works. Every model of the tier goes to $SPECMESH_TEST_DEVICE (default cuda; the
# CPU-kernel tests skip there). Writes into OUTDIR: gpu.txt (device, versions), stages.txt (each
# stage's exit status and seconds), engine_micro_gpu_{256,2048}.{json,md} (the verify forward at
# contexts 256 and 2,048, both verify modes, as `specmesh bench --micro`) and model_tier.log
# (pytest -ra). Each stage is bounded by `timeout` (the whole fits a 10-minute slot) and a failing
# stage does not stop the next; the exit status is the first failure's.
set -u
out=${1:?usage: device_check.sh OUTDIR}
mkdir -p "$out"
py=${PY:-python3}
# the tier needs no pytest plugins (an image's own may not load under the pinned pytest)
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 SPECMESH_TEST_DEVICE=${SPECMESH_TEST_DEVICE:-cuda}
status=0
stage() {  # stage NAME SECONDS CMD...: run, log the outcome, remember the first failure
  local name=$1 limit=$2 rc t0=$SECONDS
  shift 2
  timeout "$limit" "$@"
  rc=$?
  echo "== stage $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$out/stages.txt"
  [ "$status" -eq 0 ] && status=$rc
  return 0
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  $py -c 'import torch, transformers, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "| transformers", transformers.__version__,
      "| python", platform.python_version(), "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")'
  grep -m1 "model name" /proc/cpuinfo; nproc; } | tee "$out/gpu.txt"

stage fetch-model 150 bash -c "set -o pipefail; $py -m specmesh.cli fetch-model 2>&1 | tail -3"
for ctx in 256 2048; do
  stage "micro-$ctx" 90 $py -m specmesh.cli bench --micro --micro-context "$ctx" --no-progress \
    --out "$out/engine_micro_gpu_$ctx.json"
done
stage model-tier ${TIER_TIMEOUT:-300} bash -c "set -o pipefail; $py -m pytest -ra --durations=12 -m model tests/model -p no:cacheprovider 2>&1 \
  | tee '$out/model_tier.log' | tail -60"
exit "$status"
