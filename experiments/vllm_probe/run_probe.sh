#!/usr/bin/env bash
# Runs the four phases, each in a fresh process (one engine at a time), then compares.
#   ./run_probe.sh                 # float32, store ./kvstore, results ./results
#   DTYPE=bfloat16 ./run_probe.sh  # store ./kvstore_bfloat16, results ./results_bfloat16
set -euo pipefail
cd "$(dirname "$0")"
source env.sh
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="$PWD/../../.venv-vllm/bin/python"
DTYPE="${DTYPE:-float32}"
if [ "$DTYPE" = float32 ]; then export STORE=kvstore RESULTS=results; else export STORE=kvstore_$DTYPE RESULTS=results_$DTYPE; fi
rm -rf "$STORE" "$RESULTS"
for phase in baseline save load corrupt; do
    /usr/bin/time -f "$phase wall %e s" $PY run_probe.py $phase --dtype "$DTYPE" --store "$PWD/$STORE" > "logs_${phase}_$DTYPE.txt" 2>&1 || { tail -40 "logs_${phase}_$DTYPE.txt"; exit 1; }
    grep -E "wall" "logs_${phase}_$DTYPE.txt"
done
$PY compare.py
