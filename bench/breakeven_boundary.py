"""Where disaggregation starts to pay, as the simulator predicts it for this machine: the break-even grid
(prompt length x offered rate, per link) beyond what `pdserve bench breakeven` can measure in a few minutes.

Same layouts and workloads as the study (pdserve/sim/breakeven_predict.py): colocated = two 1-thread `both`
replicas, disagg / auto = 1 prefill + 1 decode replica over the link, the calibrated cost model of
`pdserve sim profile --threads 1`, the study's seeded schedules. Per cell the winner by predicted goodput:
D (disagg > 1.05 x colocated), C (colocated > 1.05 x disagg), = otherwise; and auto's share of the better one.

    python bench/breakeven_boundary.py --costs costs_t1.json --prompt-lens 32,256,512,768,960 --rates 1,2,4,6 \
        --link 10gbit --link 1gbit --link 100mbit
"""
from __future__ import annotations

import argparse

from pdserve.bench import breakeven as B
from pdserve.bench import metrics as MX
from pdserve.sim import breakeven_predict as BS
from pdserve.sim.costmodel import load_cost_model


def goodput(cost, mode: str, specs, slo, blocks: int) -> float:
    lay = BS.layout(mode, "2x1")
    return BS.run(BS.link_cost(cost, BS.link_of(mode)), specs, lay, slo, blocks, 64)["slo"]["goodput_req_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    B.add_args(p)
    p.add_argument("--costs", required=True, help="costs_t1.json (`pdserve sim profile --threads 1`)")
    p.add_argument("--step-overhead", type=float, default=0.0, help="served step overhead, s (breakeven.json sim)")
    a = p.parse_args()
    cost = BS.served(load_cost_model(a.costs), a.step_overhead)
    slo = MX.SLO(a.slo_ttft, a.slo_tpot)
    blocks = BS.num_blocks(cost, a.num_gpu_blocks)
    plens, rates, olen = B._csv(a.prompt_lens, int), B._csv(a.rates), B._csv(a.output_lens, int)[0]
    print(f"output {olen} tokens, SLO TTFT {slo.ttft}s TPOT {slo.tpot}s; cell: winner (D/C/=) "
          f"G_disagg/G_colocated, auto/best")
    for link in a.link:
        print(f"\nlink {link}: prompt \\ rate " + "".join(f"{r:>16g}" for r in rates))
        for plen in plens:
            row = []
            for ci, rate in enumerate(rates):
                specs = B.cell_specs(a, plen, olen, rate, ci)
                gc, gd, ga = (goodput(cost, m, specs, slo, blocks) for m in ("colocated", f"disagg@{link}",
                                                                            f"auto@{link}"))
                w = "D" if gd > 1.05 * gc else ("C" if gc > 1.05 * gd else "=")
                best = max(gc, gd)
                row.append(f"{w} {gd / gc if gc else float('inf'):4.2f} {ga / best if best else 1:4.2f}")
            print(f"{plen:>20d} " + "".join(f"{x:>16s}" for x in row))


if __name__ == "__main__":
    main()
