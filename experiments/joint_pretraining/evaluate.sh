#!/bin/bash
# The evaluations of a joint checkpoint that the docs and assemble.py read, from the repository root:
#   bash experiments/joint_pretraining/evaluate.sh MODEL OUT_DIR [DSPARK_MODEL]
# MODEL: a run or model directory; DSPARK_MODEL: a model directory with mtp.safetensors (DSpark bench).
# R (environment): passkey items per context length (default 1024:32,4096:16,16384:8); RV: held-out
# varied items per length (default 1024:32,4096:16; fid_varied.json), RV=none skips them.
set -euo pipefail
M=$1; O=$2; D=${3:-}
B=.venv/bin
mkdir -p "$O"
$B/python experiments/joint_pretraining/chat_eval.py "$M" "$O/chat.json" > "$O/chat.log" 2>&1 &
chat=$!
$B/cedlm eval ppl --text data/corpus/val.txt --model "$M" --seq-len 256 --threads 1 --json > "$O/val_ppl.json"
$B/cedlm eval ppl --text /usr/share/common-licenses/GPL-3 --model "$M" --seq-len 256 --threads 1 --json \
    > "$O/heldout_ppl.json"
R=${R:-1024:32,4096:16,16384:8}      # passkey items per context length
RV=${RV:-1024:32,4096:16}             # held-out varied items per context length
$B/cedlm eval fidelity --model "$M" --lengths 1024 --samples 2 --retrieval-samples $R --retrieval-kinds passkey \
    --threads 1 --json > "$O/fid_trained.json"
$B/cedlm eval fidelity --model "$M" --lengths 1024 --samples 2 --retrieval-samples $R --retrieval-kinds passkey \
    --threads 1 --indexer-init --json > "$O/fid_init.json"
if [ "$RV" != none ]; then
    $B/cedlm eval fidelity --model "$M" --lengths 1024 --samples 1 --retrieval-samples $RV --retrieval-kinds varied \
        --threads 1 --json > "$O/fid_varied.json"
fi
wait $chat
if [ -n "$D" ]; then
    $B/cedlm bench --only dspark --dspark-model "$D" --out "$O/bench" --threads 1 > "$O/bench.log" 2>&1
fi
echo "wrote $O"
