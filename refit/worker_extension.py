"""The class vLLM mixes into each worker (``worker_extension_cls``) so rlfleet can reach the worker process.

Methods here run inside the engine's worker process, called through
``collective_rpc``. The refit transport (receiving weights and applying them
through ``model_runner.reload_weights``) builds on this class.
"""

from __future__ import annotations

import os


class RefitWorkerExtension:
    """Mixed into vLLM's worker class. ``self`` is the worker (has ``model_runner``)."""

    _rlfleet_weight_version: int = 0

    def rlfleet_worker_info(self) -> dict:
        """Process facts of this worker: pid, resident memory (MB) and the stamped weight version."""
        rss_mb = 0.0
        try:
            with open(f"/proc/{os.getpid()}/statm") as f:
                rss_mb = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        except OSError:
            pass
        return {"pid": os.getpid(), "rss_mb": rss_mb, "weight_version": self._rlfleet_weight_version}
