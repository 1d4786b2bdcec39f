#!/usr/bin/env bash
# The README's main job: `coserve up` on the sample manifest, then a short `coserve bench` against it.
#
#   scripts/demo.sh [MANIFEST] [PORT]
#
# The pool runs in the background; the bench waits for its router, replays a short agentic workload,
# prints the latency table and writes coserve-bench/bench.json and bench.png. The pool is stopped with
# SIGTERM (its clean shutdown) however this script ends.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
MANIFEST=${1:-examples/pool.yaml}
PORT=${2:-${DEMO_PORT:-18080}}
OUT=${DEMO_OUTPUT:-coserve-bench}

"$BIN/coserve" up "$MANIFEST" --port "$PORT" &
up=$!
stop() { kill -TERM "$up" 2>/dev/null || true; wait "$up" 2>/dev/null || true; }
trap stop EXIT

# Wait for the router (engines take about a minute on CPUs); give up early if the pool died.
for _ in $(seq 1 600); do
    if ! kill -0 "$up" 2>/dev/null; then
        wait "$up" || status=$?
        echo "demo: coserve up exited (status ${status:-0}) before its router answered" >&2
        exit 1
    fi
    if "$BIN/python" -c "import urllib.request,sys; urllib.request.urlopen(sys.argv[1], timeout=2)" \
        "http://127.0.0.1:$PORT/health" 2>/dev/null; then
        break
    fi
    sleep 1
done

"$BIN/coserve" bench --url "http://127.0.0.1:$PORT" --wait 60 --workload agentic \
    --conversations 6 --turns 3 --first 512 --rate 0.5 --gap 1 --output "$OUT"
