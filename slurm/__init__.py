"""The Slurm launcher's sources, shipped as package data: ``rlfleet.sbatch.in`` (the
sbatch template) and ``rlfleet_step.py`` (the per-step supervisor it embeds).

Nothing here is imported for its code; ``cli.slurm`` reads the files with
``importlib.resources`` so ``rlfleet slurm submit`` works from any install.
"""
