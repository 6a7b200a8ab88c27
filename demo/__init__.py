"""``rlfleet demo``: async GRPO on the tiny model through injected faults, with a live view and a report.

A client of ``fleet`` (the control plane), ``recipe`` (the trainer) and ``faults`` (firing plans, invariants).
"""
