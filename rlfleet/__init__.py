"""rlfleet: a fault-tolerant fleet of vLLM generation engines for asynchronous RL, on Ray.

``from rlfleet import Fleet`` is the trainer's entry; everything else is under ``rlfleet.``: ``rlfleet.fleet``
(the fleet: its control plane, data plane, shards, config), ``rlfleet.refit`` (weight transfer),
``rlfleet.health`` (the pure state machines), ``rlfleet.recipe`` (async GRPO), ``rlfleet.serve`` (the HTTP
front), ``rlfleet.rlapi`` (vLLM's RL API and TRL), ``rlfleet.faults``, ``rlfleet.sim``, ``rlfleet.demo``,
``rlfleet.cli`` and ``rlfleet.slurm``.

In the repository those packages are top-level folders (``fleet/``, ``refit/``, ...); the wheel maps them
under ``rlfleet/`` (pyproject's ``tool.setuptools.package-dir``). A checkout on ``sys.path`` (a plain clone,
``PYTHONPATH``, a worktree) finds them through this package's path, extended below to the repository's root
when this file sits in one. Importing ``rlfleet`` loads neither Ray nor vLLM: ``Fleet`` and ``FleetConfig``
load on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

__all__ = ["Fleet", "FleetConfig", "__version__"]

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "fleet" / "__init__.py").is_file():
    __path__.append(str(_ROOT))  # a checkout: rlfleet.fleet is <root>/fleet (an installed wheel has rlfleet/fleet)

_EXPORTS = {"Fleet": "rlfleet.fleet.api", "FleetConfig": "rlfleet.fleet.config.fleet"}

if TYPE_CHECKING:
    from rlfleet.fleet.api import Fleet
    from rlfleet.fleet.config.fleet import FleetConfig


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("rlfleet")
        except PackageNotFoundError:  # a checkout that was never installed
            return "0+unknown"
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlfleet' has no attribute {name!r}")
