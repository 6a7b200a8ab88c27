"""Fault campaigns on real fleets: the plan runner, the matrix, the chaos soak, the invariant checker,
the event-log analysis they share, the proof that each fault fired (``evidence``), and the one weight
source tests, benchmarks and campaigns use.

A client of ``fleet``; the pure plans themselves live in ``health.faultplan``.
"""
