"""A serving process freezes its collector heap once up, as ``vllm serve`` does, and exits quietly (``fleet.gc_heap``)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc
import vllm.v1.engine.output_processor  # noqa: F401 - what a shard's process holds (Triton's nanobind modules)
from rlfleet.fleet.gc_heap import freeze_started_heap
freeze_started_heap()
freeze_started_heap()  # a second call: one unfreeze at exit still
print("frozen", gc.get_freeze_count())
"""


def test_the_heap_is_frozen_once_up_and_unfrozen_at_exit_so_no_extension_reports_leaks():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    frozen = int(done.stdout.split()[-1])
    assert frozen > 10_000  # vLLM and torch's objects: out of the collector's generations
    assert "leaked" not in done.stderr, done.stderr[-2000:]  # frozen at exit, nanobind named each as a leak
