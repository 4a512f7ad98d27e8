"""Cluster-scale discrete-event simulation over the engine's real Scheduler and BlockManager (docs/sim.md)."""
