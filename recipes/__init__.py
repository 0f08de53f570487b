"""The command layer: `python -m recipes.NAME`. Importing it measures the load the command starts under
before torch loads OpenMP, which reads its wait policy only then (recipes.cpuload)."""

from recipes.cpuload import prefer_passive_wait

prefer_passive_wait()
