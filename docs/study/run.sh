#!/usr/bin/env bash
# The study of docs/results.md: the STRING paper's comparison in miniature on the default
# model (SmolLM2-135M-Instruct, L = 8192), every method, n and interval per cell. `make study` runs it.
#
# Every step resumes its results folder (runs/study_*), so the script can be stopped and started again
# at any point; a step that is complete costs only the model's loading. At the end the reports of the
# folders that hold results are copied to docs/study/<part>/ and docs/study/index.md is rebuilt.
# Hours of CPU time (docs/study/index.md, "Time per case"); on a GPU, add nothing: the runner uses it.
#
# Precision: bfloat16, as STRING's and RULER's own runs load their models; on a CPU with AMX it is also
# twice as fast as float32 (on one with AVX2 only, 40 times slower: step 3's passkey at 16K, below, ran in
# float32 for that reason). Batch: 8 cases decoded together (left-padded; the answers equal batch 1's).
set -euo pipefail
cd "$(dirname "$0")/../.."
LONGREACH=${LONGREACH:-.venv/bin/longreach}
RUN="--model default --dtype bfloat16 --batch-size ${BATCH:-8}"
RUN_FLOAT32="--model default --dtype float32 --batch-size 1"
DPE_8K="dpe:dimensions=docs/study/dpe_dimensions_8k.safetensors,group_scales=2;2;2;2;2;2;2;2,local_window=1024,top_k=24"
DPE_16K="dpe:dimensions=docs/study/dpe_dimensions_16k.safetensors,group_scales=4;4;4;4;4;4;4;4,local_window=1024,top_k=24"

# A fresh clone resumes from the published results: a results folder that is absent starts from the copy
# that the last publish left in docs/study/<part>/ (cases run after that publish are run again).
PARTS=(window ruler beyond beyond_float32 beyond_bfloat16_partial)  # runs/study_<part>, published to docs/study/<part>
for part in "${PARTS[@]}"; do
    if [ ! -e "runs/study_$part/results.jsonl" ] && [ -e "docs/study/$part/results.jsonl" ]; then
        mkdir -p "runs/study_$part" && cp "docs/study/$part/results.jsonl" "runs/study_$part/results.jsonl"
    fi
done

# 1. Inside the window (the paper's Table 1 in miniature): 50 cases per cell for rope and string ...
$LONGREACH eval niah4 passkey $RUN --lengths 2k,4k,6k,8k --samples 50 --out runs/study_window \
    --method rope --method string
# ... and 20 for string with its mscale, the paper's baselines under its protocol, and DPE (calibrated at 8K).
$LONGREACH eval niah4 passkey $RUN --lengths 2k,4k,6k,8k --samples 20 --out runs/study_window \
    --method string:mscale=true --method ntk:protocol=paper --method yarn:protocol=paper --method rerope:protocol=paper \
    --method self_extend:protocol=paper --method dca:protocol=paper --method "$DPE_8K"

# 2. RULER at 4K and 8K, 10 cases per task: rope, string and the two best others of step 1
#    (highest mean score over both tasks and all four lengths, on the same 20 cases per cell).
#    It ran with each case packed to the length, before ruler:* took RULER's own sizing: ruler-tight.
BEST=$(.venv/bin/python -m longreach.study best runs/study_window --exclude rope string --count 2)
$LONGREACH eval ruler-tight $RUN --lengths 4k,8k --samples 10 --out runs/study_ruler --method rope --method string \
    $(for m in $BEST; do printf -- '--method %s ' "$m"; done)

# 3. Beyond the window (12K and 16K = 2L), 20 cases per cell; rope is the floor.
BEYOND=(--method rope --method dca --method self_extend --method yarn:factor=2 --method string+yarn:factor=2 --method "$DPE_16K")
$LONGREACH eval niah4 $RUN --lengths 12k,16k --samples 20 --out runs/study_beyond "${BEYOND[@]}"
$LONGREACH eval passkey $RUN --lengths 12k --samples 20 --out runs/study_beyond "${BEYOND[@]}"
# Passkey at 16K runs in float32: the study moved to a CPU without bfloat16 arithmetic (AVX2 only, where torch's
# bfloat16 matrix product is some 40 times slower than float32's) after 80 of its 120 cases had run in bfloat16;
# those 80 stay as they ran, in runs/study_beyond_bfloat16_partial (published, not rerun: the precision check).
# One case at a time: there a left-padded batch of 8 took 220 s per case against 106 s for a lone case, same
# answers (the model's MLP over 8 x 16K activations outgrows the CPU's cache; docs/results.md).
$LONGREACH eval passkey $RUN_FLOAT32 --lengths 16k --samples 20 --out runs/study_beyond_float32 "${BEYOND[@]}"

.venv/bin/python -m longreach.study publish "${PARTS[@]/#/runs/study_}" --to docs/study
