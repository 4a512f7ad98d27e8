"""Tensor parallelism inside one worker: one process per rank, rank 0 schedules, every rank executes
(docs/engine.md, "Tensor parallelism")."""
