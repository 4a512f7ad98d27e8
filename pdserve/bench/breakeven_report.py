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
