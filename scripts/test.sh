#!/usr/bin/env bash
# Run the test suite. Prints every test's duration and, at the end, the engine starts the run cost.
#
#   bash scripts/test.sh            # everything (what CI runs): the type check, then unit, integration,
#                                   # fault matrix, soak
#   bash scripts/test.sh --quick    # the edit loop: the type check, then the unit tests and the integration
#                                   # modules that cost seconds (marked ``quick``), in at most 5 minutes
#   bash scripts/test.sh ARGS...    # one pytest with ARGS (a path narrows it; no path: tests/; -k, -x, ...)
#
# The type check (scripts/typecheck.sh: mypy over fleet, health, refit, rlapi and serve, a few seconds) runs
# before any test, and a type error fails the run: --quick and the full run do not start their tests then.
#
# The full run is two lanes at once, each its own pytest and its own local Ray: the suite is mostly one
# process waiting on another (an engine starting, a deadline, a subprocess CLI), and run as one lane it
# kept one of the machine's two cores idle about half the time. Lane "fleets": the integration tests
# (real fleets, the shared ones among them), at a lower CPU priority. Lane "matrix": the unit tests, the
# demo's signal tests, the fault matrix, the soak (whose health deadlines are the tighter) and TRL's
# training run against ``rlfleet serve`` (its own fleet; this lane ends earlier). Each lane's
# lines are prefixed with its name; the script fails when either lane fails, and ends with both lanes'
# results and the engine starts of the whole run.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
if [ "${1:-}" = "--quick" ]; then
  shift
  bash scripts/typecheck.sh
  exec python -m pytest tests -p no:cacheprovider -m quick "$@"
fi
if [ "$#" -gt 0 ]; then
  # pytest's testpaths (pyproject) is tests/: a path given here narrows the run instead of adding to it
  exec python -m pytest -p no:cacheprovider "$@"
fi

bash scripts/typecheck.sh  # once, before the lanes: a type error fails the run here
work=$(mktemp -d -t rlfleet-test-XXXXXX)
SIGNALS=tests/integration/test_demo_signals.py
TRL=tests/integration/test_trl.py  # its own fleet, about 2 minutes: in the lane that ends earlier
declare -A LANES=(
  [fleets]="tests/integration --ignore=$SIGNALS --ignore=$TRL"
  [matrix]="tests/unit $SIGNALS tests/faults $TRL"
)
# The matrix and the soak size their health deadlines for a test (a probe answered in 3 s, a stall found in
# 10 s): when both lanes want the CPU, the fleets lane (its engines, Ray workers and CLIs inherit it) yields.
declare -A NICE=([fleets]=10 [matrix]=0)
t0=$(date +%s)
trap 'trap - INT TERM; kill 0 2>/dev/null; exit 143' INT TERM
for lane in fleets matrix; do
  mkdir -p "$work/$lane"
  : >"$work/$lane/log"
  # shellcheck disable=SC2086  # the lane's paths and options are words
  (
    set +e
    RLFLEET_START_RECORDS="$work/$lane/starts.jsonl" PYTHONUNBUFFERED=1 \
      nice -n "${NICE[$lane]}" python -m pytest ${LANES[$lane]} -p no:cacheprovider --basetemp="$work/$lane/tmp" >"$work/$lane/log" 2>&1
    echo $? >"$work/$lane/rc"
  ) &
  tail -n +1 -F --pid=$! "$work/$lane/log" 2>/dev/null | sed -u "s/^/[$lane] /" &
done
wait

echo
echo "================ both lanes, $(( $(date +%s) - t0 )) s wall ================"
status=0
for lane in fleets matrix; do
  rc=$(cat "$work/$lane/rc")
  echo "[$lane] exit $rc: $(grep -E '^=+ .*(passed|failed|error).* in ' "$work/$lane/log" | tail -1 | tr -d '=')"
  [ "$rc" = 0 ] || status=1
done
# What failed, at the end where a log's tail shows it (each lane's own summary is above its durations).
for lane in fleets matrix; do
  grep -E '^(FAILED|ERROR) ' "$work/$lane/log" | cut -c1-600 | head -20 | sed "s/^/[$lane] /" || true
  # pytest cuts the summary line at the terminal's width: the first assertion lines whole
  [ "$(cat "$work/$lane/rc")" = 0 ] || grep -E '^E  ' "$work/$lane/log" | cut -c1-1500 | head -12 | sed "s/^/[$lane] /" || true
done
python - "$work/fleets/starts.jsonl" "$work/matrix/starts.jsonl" <<'EOF'
import sys
from fleet.shard.start_records import read_starts, summarize
print("whole run:", summarize([r for path in sys.argv[1:] for r in read_starts(path)]))
EOF
echo "lane logs: $work/fleets/log $work/matrix/log"
exit $status
