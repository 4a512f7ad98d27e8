"""The SLA planner (docs/planner.md): sizes the prefill and decode pools from measured load.

One concept per module: `scrape` (Prometheus text -> a counter snapshot -> one interval's `Observation`),
`predictor` (the next interval's load), `costs` (the simulator's cost model from the workers' live measurements),
`policy` (replica counts meeting the SLOs at the least GPU count, by `pdserve/sim/plan.py`), `guard` (the guard
rails), `decision` (what was decided and why: metrics, log line, Redis record), `loop` (the control loop),
`connectors/` (who applies a count: a local `pdserve up`, or Kubernetes), `status` (`pdserve status`).
"""
