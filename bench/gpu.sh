#!/usr/bin/env bash
# A GPU session's first two commands, meant to run back to back on one warm machine (each under about 7 minutes
# on an H100, so that both fit a session's 15 minutes with the machine's start):
#
#   bench/gpu.sh 1    a decoding step against SDPA's at 32K and 128K (eager), generate under CUDA graphs
#                     (bench/gpu_probe.py --part generate), prefill at 8K and 32K, the probe (every never-run path
#                     checked, auto's choices, each route's time and memory against SDPA at 8K, 32K and 128K), then
#                     the FlashAttention emulation of the CUDA tests against PyTorch's own kernel
#                     (bench/flash_emulation_check.py)
#   bench/gpu.sh 2    tests/test_cuda.py in three groups, the riskiest paths first, each in its own process; then the
#                     default model end to end
#   add --device cpu  a dry run on the CPU at small sizes (the CUDA tests skip)
#
# Nothing stops at a failure: every step has its own time budget, its log ($OUT/NAME.log) and its exit status
# ($OUT/steps.tsv). Everything is written under $OUT (default bench/out), the only folder a device machine sends
# back: the tables go to $OUT/RESULTS.md, a fragment to paste into bench/RESULTS.md (bench/RESULTS.md is left
# alone), the junit files to $OUT/tests-*.xml, the probe to $OUT/gpu_probe_kernels.json and gpu_probe_generate.json,
# the emulation check to $OUT/flash_emulation.json.
# Python: $PYTHON, else the project's .venv, else python3 (the device machine's own torch and transformers).
set -uo pipefail
cd "$(dirname "$0")/.."

part="" device=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    1|2) part="$1"; shift ;;
    --device) device="${2:-}"; shift 2 ;;
    --device=*) device="${1#--device=}"; shift ;;
    *) echo "bench/gpu.sh: unknown argument '$1' (allowed: 1 or 2, --device cuda|cpu)" >&2; exit 2 ;;
  esac
done
case "$device" in cuda|cpu) ;; *) echo "bench/gpu.sh: --device $device is not one of: cuda, cpu" >&2; exit 2 ;; esac
[ -n "$part" ] || { echo "bench/gpu.sh: which part? 1 (probe and benchmarks) or 2 (CUDA tests)" >&2; exit 2; }

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
out="${OUT:-bench/out}"
mkdir -p "$out"
export LONGREACH_CACHE="${LONGREACH_CACHE:-$out/cache}" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" BENCH_RESULTS="$out/RESULTS.md" PYTHONUNBUFFERED=1 OUT="$out"
methods=rope,string,rerope,self_extend,dca

if [ "$device" = cuda ]; then
  "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: no CUDA device here; use --device cpu for a dry run")' || exit 2
  layer=(--heads 32 --kv-heads 8 --dim 128 --dtype bfloat16 --device cuda --write)
  prefill_lengths=8192,32768; decode_lengths=32768,131072
  model=(--length 16384 --steps 10 --rounds 1 --new-tokens 32 --device cuda --dtype bfloat16 --weights random --write)
  scale=1
else
  layer=(--heads 4 --kv-heads 2 --dim 32 --dtype float32 --device cpu --write)
  prefill_lengths=512,1024; decode_lengths=1024
  model=(--length 512 --steps 2 --rounds 1 --new-tokens 4 --device cpu --dtype float32 --weights random --write)
  scale=4  # the dry run's budgets: the CPU is slower at its small sizes than the GPU at its large ones, and may be shared
fi

step() {  # step NAME SECONDS COMMAND...: runs it within its budget, never stops the script
  local name=$1 budget=$(( $2 * scale )); shift 2
  local began=$SECONDS
  echo; echo "== $name ($(date -u +%H:%M:%S), budget ${budget} s)"
  timeout --signal=INT --kill-after=15 "$budget" "$@" > "$out/$name.log" 2>&1
  local status=$?
  tail -n 12 "$out/$name.log"
  printf '%s\t%s\t%s s\n' "$name" "$status" "$((SECONDS - began))" | tee -a "$out/steps.tsv"
}

"$python" -c 'import torch; print("torch", torch.__version__, "cuDNN", torch.backends.cudnn.version(), torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")' | tee "$out/env-$part.txt"
start=$SECONDS
if [ "$part" = 1 ]; then
  # decoding first (eager, then under CUDA graphs), then prefill, then every path's check, then the emulation's
  step decode-auto 50 "$python" bench/attention.py "${layer[@]}" --rounds 10 --lengths "$decode_lengths" --methods "$methods" --decode
  step generate 120 "$python" bench/gpu_probe.py --device "$device" --part generate
  step prefill-auto 80 "$python" bench/attention.py "${layer[@]}" --rounds 3 --lengths "$prefill_lengths" --methods "$methods"
  step probe 140 "$python" bench/gpu_probe.py --device "$device" --part kernels
  step emulation 30 "$python" bench/flash_emulation_check.py --device "$device"
else
  # the paths that have never run on a GPU first, in their own process: an illegal address poisons a process
  step tests-new 120 "$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider --junitxml="$out/tests-new.xml" -k "triton or flash or cudnn or bfloat16 or auto_takes"
  step tests-kernel 150 "$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider --junitxml="$out/tests-kernel.xml" -k "not (triton or flash or cudnn or bfloat16 or auto_takes or models)"
  step tests-models 100 "$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider --junitxml="$out/tests-models.xml" -k models
  step model 70 "$python" bench/model.py "${model[@]}" --methods "$methods"
fi
echo; echo "bench/gpu.sh $part: done in $((SECONDS - start)) s; steps in $out/steps.tsv, tables in $out/RESULTS.md, logs in $out"
