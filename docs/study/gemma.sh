#!/usr/bin/env bash
# The second study of docs/results.md: Gemma 3 270M (base, L = 32,768; 18 layers, every 6th global, the rest sliding
# over 512 tokens), offline (`--model gemma3-270m`). `make study-gemma` runs it.
#
# Resumable as docs/study/run.sh: run it again to go on; a fresh clone starts from the published results
# (docs/study/gemma3-270m/gemma/results.jsonl). Sized from the cost per case measured here first (2 cores, bfloat16, one case at
# a time): about 120 s for a passkey case at 32K and 130-290 s for a 4-needle case (128 tokens to decode), about
# twice that at 48K; the whole grid is about two hours.
set -euo pipefail
cd "$(dirname "$0")/../.."
LONGREACH=${LONGREACH:-.venv/bin/longreach}
RUN="--model gemma3-270m --dtype bfloat16 --batch-size 1 --out runs/study_gemma"
if [ ! -e runs/study_gemma/results.jsonl ] && [ -e docs/study/gemma3-270m/gemma/results.jsonl ]; then
    mkdir -p runs/study_gemma && cp docs/study/gemma3-270m/gemma/results.jsonl runs/study_gemma/results.jsonl
fi

# 1. Inside the window: stock RoPE, STRING, and DCA (the method that did best past SmolLM2's window, needing no
#    calibration). STRING (S = 10,923) equals RoPE below 10,923 tokens and DCA (chunk 24,576) below 24,576: their
#    4K and 8K cells (and DCA's 16K) are the pipeline's check, case for case.
WINDOW=(--method rope --method string --method dca)
$LONGREACH eval passkey niah4 $RUN --lengths 4k,8k,16k --samples 5 "${WINDOW[@]}"
$LONGREACH eval passkey niah4 $RUN --lengths 32k --samples 4 "${WINDOW[@]}"

# 2. Beyond the window, 48K = 1.5 L: YaRN (factor 1.5, on the global layers, as Google scales Gemma 3's larger models),
#    alone and under STRING.
$LONGREACH eval passkey niah4 $RUN --lengths 48k --samples 2 --method yarn:factor=1.5 --method string+yarn:factor=1.5

.venv/bin/python -m longreach.study publish runs/study_gemma --to docs/study/gemma3-270m
