"""The break-even study's prediction and target tables: markdown (`breakeven_table.md`) and HTML sections."""
from __future__ import annotations

import html as H

from pdserve.bench import breakeven_targets as T

COLS = (("goodput_req_per_s", "goodput req/s", 1.0), ("ttft_p50_s", "TTFT p50 ms", 1e3),
        ("tpot_p50_s", "TPOT p50 ms", 1e3))


def _n(x, scale=1.0) -> str:
    return "n/a" if x is None else f"{x * scale:.3g}"


def _e(e, absolute=False) -> str:
    return "n/a" if e is None else (f"{e:+.2f}" if absolute else f"{e:+.0%}")


def sim_rows(results: dict, grid) -> list[list[str]]:
    """One row per (mode, cell) with a prediction: measured / predicted / error per quantity."""
    rows = []
    for mode in results:
        cells = results[mode].get("cells", {})
        for plen, olen, rate in grid:
            c = cells.get(f"{plen}x{olen}x{rate:g}")
            if not c or "sim" not in c:
                continue
            row = [mode, str(plen), str(olen), f"{rate:g}"]
            for key, _, scale in COLS:
                q = c["sim"][key]
                row.append(f"{_n(q['measured'], scale)} / {_n(q['predicted'], scale)} / {_e(q['error'])}")
            q = c["sim"]["attainment_ratio"]
            row.append(f"{_n(q['measured'])} / {_n(q['predicted'])} / {_e(q['error'], True)}")
            rows.append(row)
    return rows


HEAD = ["mode", "prompt", "output", "rate", *(f"{c[1]} meas / sim / err" for c in COLS),
        "attainment meas / sim / diff"]


def markdown(results: dict, grid, targets: dict) -> str:
    rows = sim_rows(results, grid)
    out = ["| " + " | ".join(HEAD) + " |", "|" + " --- |" * len(HEAD)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    out += ["", *[f"- {x}" for x in T.lines(targets)]]
    return "\n".join(out) + "\n"


def html_sections(results: dict, grid, targets: dict) -> list[tuple[str, str]]:
    rows = sim_rows(results, grid)
    table = ("<table><tr>" + "".join(f"<th>{H.escape(h)}</th>" for h in HEAD) + "</tr>" +
             "".join("<tr>" + "".join(f"<td>{H.escape(v)}</td>" for v in r) + "</tr>" for r in rows) + "</table>")
    sims = "".join(f"<li><b>{H.escape(m)}</b>: {H.escape(str(r['sim']))}</li>" for m, r in results.items()
                   if isinstance(r.get("sim"), dict))
    met = {k: v["met"] for k, v in targets.items()}
    tl = "".join(f"<li>{H.escape(x)}</li>" for x in T.lines(targets))
    return [("Targets", f"<p>{H.escape(str(met))}</p><ul>{tl}</ul>"),
            ("Simulated vs measured, per cell (error = (sim - measured) / measured; the simulator leaves out the "
             "HTTP / router front-end)", table + f"<ul>{sims}</ul>")]


def plot_auto(rows: list[dict], path):
    """Heat map of the auto target: per link, prompt x output (rows) by rate (columns), colour = auto goodput over
    the better of colocated and disaggregated (white at 1; red below the 0.95 target)."""
    from pdserve.bench.report import pyplot
    plt = pyplot()
    if plt is None or not rows:
        return None
    links = list(dict.fromkeys(r["link"] for r in rows))
    keys = [tuple(r["cell"].split("x")) for r in rows]
    pos = sorted({(int(p), int(o)) for p, o, _ in keys})
    rates = sorted({float(x) for _, _, x in keys})
    fig, axes = plt.subplots(1, len(links), figsize=(2.2 + 1.5 * len(rates) * len(links), 1.6 + 0.8 * len(pos)),
                             squeeze=False)
    im = None
    for ax, link in zip(axes[0], links):
        grid = [[float("nan")] * len(rates) for _ in pos]
        for r, (p, o, x) in zip(rows, keys):
            if r["link"] != link:
                continue
            i, j = pos.index((int(p), int(o))), rates.index(float(x))
            grid[i][j] = 1.0 if r["ratio"] is None else r["ratio"]
            mark = "" if r["met"] else ("✗≈" if r["within_noise"] else "✗")
            rt = "–" if r["ratio"] is None else f"×{r['ratio']:.2f}"
            ax.text(j, i, f"{mark}{rt}\nA {r['goodput_auto']:.2f}\n{r['best'][0].upper()} {r['goodput_best']:.2f}",
                    ha="center", va="center", fontsize=8)
        im = ax.imshow(grid, cmap="RdBu", vmin=0.5, vmax=1.5, origin="lower", aspect="auto")
        ax.set_xticks(range(len(rates)), [f"{x:g}" for x in rates])
        ax.set_yticks(range(len(pos)), [f"P={p} O={o}" if ax is axes[0][0] else "" for p, o in pos])
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(f"link {link}", fontsize=10)
    fig.suptitle("auto goodput / max(colocated, disagg); target ≥ 0.95 (✗: missed, ≈: within noise)\n"
                 "cells: ratio, auto goodput, best mode's goodput (C/D) req/s", fontsize=9, y=1.03)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path
