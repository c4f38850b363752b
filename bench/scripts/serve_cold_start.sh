#!/usr/bin/env bash
# Time to the first answer of `cedlm serve` with empty caches, as a new user has them:
# seconds until the port answers, until /health is 200, and until one chat completion returns.
#   bench/scripts/serve_cold_start.sh            # the shipped model
#   EXTRA="--speculative" bench/scripts/serve_cold_start.sh
#   WARM=1 bench/scripts/serve_cold_start.sh     # a warm start: the user's caches, graphs built
#                                                # first by `cedlm warmup` (not timed)
set -euo pipefail
cd "$(dirname "$0")/../.."
D=$(mktemp -d)
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true; rm -rf "$D"' EXIT
if [ "${WARM:-0}" = "1" ]; then
  # shellcheck disable=SC2086
  .venv/bin/cedlm warmup ${EXTRA:-} > "$D/warmup.log" 2>&1 || { cat "$D/warmup.log"; exit 1; }
else
  export TORCHINDUCTOR_CACHE_DIR=$D/inductor CEDLM_CACHE_DIR=$D/cache
fi
PORT=${PORT:-8311}
t0=$(date +%s.%N)
# shellcheck disable=SC2086
.venv/bin/cedlm serve --port "$PORT" ${EXTRA:-} > "$D/serve.log" 2>&1 &
PID=$!
listen=""
while true; do
  code=$(curl -s -o /dev/null -w '%{http_code}' "localhost:$PORT/health" || true)
  now=$(date +%s.%N)
  if [ -z "$listen" ] && [ "$code" != "000" ]; then listen=$(echo "$now - $t0" | bc); fi
  if [ "$code" = "200" ]; then ready=$(echo "$now - $t0" | bc); break; fi
  kill -0 $PID 2>/dev/null || { cat "$D/serve.log"; exit 1; }
  sleep 0.1
done
curl -s "localhost:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "cedlm", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 20}' \
  > "$D/chat.json"
answered=$(echo "$(date +%s.%N) - $t0" | bc)
echo "listening_s=$listen ready_s=$ready first_answer_s=$answered"
curl -s "localhost:$PORT/health"; echo
