#!/usr/bin/env bash
# Static type check of the packages fleet/, health/, refit/, rlapi/ and serve/ with mypy, configured in
# pyproject.toml ([tool.mypy]: which third-party packages are not followed). It catches, among others, an
# attribute used through a Protocol that the protocol does not declare (``Parts.act``'s ``Actions``,
# ``EngineBackend``). A few seconds; ``scripts/test.sh`` runs it first (--quick and the full run).
#
#   bash scripts/typecheck.sh             # exits non-zero on any type error
#   bash scripts/typecheck.sh ARGS...     # extra mypy options (e.g. --no-incremental)
#
# The code imports itself as rlfleet.fleet, rlfleet.refit, ... while the folders are top-level (pyproject's
# package-dir maps them in a wheel; rlfleet/__init__.py extends its path in a checkout). mypy follows neither,
# so it reads a view: build/typecheck/rlfleet/ holds links to rlfleet/__init__.py and to each folder. Its
# messages name the repository's paths (fleet/api.py, not the view's).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"
root=$PWD
view=build/typecheck
rm -rf "$view" && mkdir -p "$view/rlfleet"
ln -s "$root/rlfleet/__init__.py" "$view/rlfleet/__init__.py"
for pkg in fleet refit health recipe demo faults serve sim cli rlapi slurm; do
  ln -s "$root/$pkg" "$view/rlfleet/$pkg"
done
set +e
python -m mypy --cache-dir "$root/.mypy_cache" "$@" \
  "$view/rlfleet/fleet" "$view/rlfleet/health" "$view/rlfleet/refit" "$view/rlfleet/rlapi" "$view/rlfleet/serve" \
  | sed -u "s#^$view/rlfleet/##"
rc=${PIPESTATUS[0]}
exit "$rc"
