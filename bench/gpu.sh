#!/usr/bin/env bash
# A GPU session's first command: the CUDA tests, then the GPU benchmarks, into bench/RESULTS.md.
#
#   bench/gpu.sh                 on a machine with a CUDA GPU (no network needed); under 9 minutes on an H100
#   bench/gpu.sh --device cpu    a dry run on the CPU at small sizes: every step runs, the results go to
#                                $OUT/RESULTS.md (bench/RESULTS.md is left alone), the CUDA tests are skipped
#
# Steps: (1) tests/test_cuda.py, junit XML in $OUT/cuda-tests.xml; (2) the attention benchmark, a
# Llama-8B-shaped layer (32 query / 8 KV heads, head dim 128, bfloat16): prefill at 8K, 32K and 128K and a
# decoding step at 32K and 128K, every position method, against causal SDPA in the same run (CUDA events,
# the warm-up round excluded, the kernel SDPA picked recorded), and prefill with the fused Triton kernel at 8K and
# 32K beside FlexAttention's, and PyTorch's FlashAttention one call per part with a window (cuda_flash);
# (3) the default model end to end at 16K (its shape with random weights: the GPU machine has no network and cannot be sent the model).
# Python: $PYTHON, else the project's .venv, else python3 (the device machine's own torch and transformers).
# $OUT: where logs and the junit file go (default bench/out).
set -euo pipefail
cd "$(dirname "$0")/.."

device=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --device=*) device="${1#--device=}"; shift ;;
    *) echo "bench/gpu.sh: unknown argument '$1' (allowed: --device cuda|cpu)" >&2; exit 2 ;;
  esac
done
case "$device" in cuda|cpu) ;; *) echo "bench/gpu.sh: --device $device is not one of: cuda, cpu" >&2; exit 2 ;; esac

python="${PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
out="${OUT:-bench/out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
methods=rope,string,rerope,self_extend,dca

if [ "$device" = cuda ]; then
  "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "bench/gpu.sh: no CUDA device here; use --device cpu for a dry run")'
  layer=(--heads 32 --kv-heads 8 --dim 128 --dtype bfloat16 --device cuda --rounds 3)
  prefill_lengths=8192,32768,131072; decode_lengths=32768,131072
  model=(--length 16384 --steps 15 --rounds 2 --new-tokens 64 --device cuda --dtype bfloat16 --weights random)
  write=--write
else
  export BENCH_RESULTS="$out/RESULTS.md"
  layer=(--heads 4 --kv-heads 2 --dim 32 --dtype float32 --device cpu --rounds 1)
  prefill_lengths=512,1024; decode_lengths=1024
  model=(--length 512 --steps 2 --rounds 1 --new-tokens 4 --device cpu --dtype float32 --weights random)
  write=--write
fi

step() { echo; echo "== $1 ($(date -u +%H:%M:%S))"; }
start=$SECONDS
step "CUDA tests -> $out/cuda-tests.xml"
tests=0
"$python" -m pytest tests/test_cuda.py -q -p no:cacheprovider --junitxml="$out/cuda-tests.xml" > "$out/cuda-tests.log" 2>&1 || tests=$?
tail -n 5 "$out/cuda-tests.log"  # a failing test is reported at the end; the benchmarks still run
step "attention, causal prefill"
"$python" bench/attention.py "${layer[@]}" --lengths "$prefill_lengths" --methods "$methods" $write 2>&1 | tee "$out/attention-prefill.log"
step "attention, decoding step"
"$python" bench/attention.py "${layer[@]}" --lengths "$decode_lengths" --methods "$methods" --decode $write 2>&1 | tee "$out/attention-decode.log"
step "attention, causal prefill, cuDNN's attention on whole causal blocks (cuda_cudnn, auto's choice for CUDA prefill)"
if [ "$device" = cuda ]; then
  "$python" bench/attention.py "${layer[@]}" --lengths 8192,32768 --methods rope,string,rerope,self_extend --backend cuda_cudnn $write 2>&1 | tee "$out/attention-prefill-cuda-cudnn.log"
else
  echo "skipped: cuDNN's attention needs CUDA"
fi
step "attention, causal prefill, the fused Triton kernel (auto takes it for decoding steps only)"
if [ "$device" = cuda ]; then
  "$python" bench/attention.py "${layer[@]}" --lengths 8192,32768 --methods "$methods" --backend triton $write 2>&1 | tee "$out/attention-prefill-triton.log"
elif "$python" -c 'import triton' 2>/dev/null; then  # Triton's interpreter: tiny sizes
  TRITON_INTERPRET=1 "$python" bench/attention.py "${layer[@]}" --lengths 512 --methods "$methods" --backend triton $write 2>&1 | tee "$out/attention-prefill-triton.log"
else
  echo "skipped: Triton is not installed"
fi
step "attention, PyTorch's FlashAttention one call per part with a window (cuda_flash, the official STRING algorithm)"
if [ "$device" = cuda ]; then
  "$python" bench/attention.py "${layer[@]}" --lengths 8192,32768 --methods rope,string,rerope,self_extend --backend cuda_flash $write 2>&1 | tee "$out/attention-prefill-cuda-flash.log"
  "$python" bench/attention.py "${layer[@]}" --lengths "$decode_lengths" --methods rope,string,rerope,self_extend --backend cuda_flash --decode $write 2>&1 | tee "$out/attention-decode-cuda-flash.log"
else
  echo "skipped: FlashAttention needs CUDA"
fi
step "the default model end to end"
"$python" bench/model.py "${model[@]}" --methods "$methods" $write 2>&1 | tee "$out/model.log"
echo; echo "bench/gpu.sh: done in $((SECONDS - start)) s; tables in ${BENCH_RESULTS:-bench/RESULTS.md}, logs in $out"
if [ "$tests" -ne 0 ]; then echo "bench/gpu.sh: the CUDA tests failed (exit $tests): see $out/cuda-tests.log" >&2; exit "$tests"; fi
