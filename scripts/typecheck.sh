#!/usr/bin/env bash
# Static type check of the packages fleet/, health/, refit/, rlapi/ and serve/ with mypy, configured in
# pyproject.toml ([tool.mypy]: which packages, which third-party ones are not followed). It catches, among
# others, an attribute used through a Protocol that the protocol does not declare (``Parts.act``'s
# ``Actions``, ``EngineBackend``). A few seconds; ``scripts/test.sh`` runs it first (--quick and the full run).
#
#   bash scripts/typecheck.sh             # exits non-zero on any type error
#   bash scripts/typecheck.sh ARGS...     # extra mypy options (e.g. --no-incremental)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"
exec python -m mypy "$@"
