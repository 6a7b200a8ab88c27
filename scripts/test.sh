#!/usr/bin/env bash
# Run the test suite. Prints every test's duration and, at the end, the engine starts the run cost.
#
#   bash scripts/test.sh            # everything (what CI runs): unit, integration, fault matrix, soak
#   bash scripts/test.sh --quick    # the edit loop: unit tests and the integration modules that cost
#                                   # seconds (marked ``quick``), in at most 5 minutes
#
# Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
if [ "${1:-}" = "--quick" ]; then
  shift
  exec python -m pytest tests -p no:cacheprovider -m quick "$@"
fi
exec python -m pytest tests -p no:cacheprovider "$@"
