"""The fleet simulator: the production controller against simulated shards, in simulated time.

``sim.run.simulate(Scenario(...))`` runs one training run; ``scripts/simulate_fleet.py``
runs 64, 256 and 1,024 engines and writes ``docs/scale.md``'s figures. Nothing in the
fleet imports this package.
"""
