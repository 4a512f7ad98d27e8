"""`pdserve bench`: open-loop load generator, spec §2 metrics, load sweeps, and the disaggregated-vs-colocated
break-even study. See docs/bench.md."""
