"""A run's lineage as one self-contained HTML file (`dlx lineage --html FILE`).

No scripts, no external assets: inline CSS and SVG only, so the file can be archived or
mailed next to the run and opened anywhere. It shows the checkpoint chain as a graph,
the loss curves, each node's stake and contributions, and every step's transaction.
"""

from __future__ import annotations

import html
from typing import Any

ETHER = 10**18
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1d2330;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #dde}
table{border-collapse:collapse;width:100%;font-size:12.5px}th,td{padding:4px 8px;border-bottom:1px solid #eef;text-align:left;vertical-align:top}
th{background:#f4f6fb}code{font:12px ui-monospace,monospace}.muted{color:#667}.kv td:first-child{width:14em;color:#556}
svg text{font:11px system-ui,sans-serif}td code{word-break:break-all}td.c{white-space:nowrap}.ok{color:#17803d}.bad{color:#b42318}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _short(cid: str, n: int = 10) -> str:
    return cid if len(cid) <= 2 * n else f"{cid[:n]}…{cid[-6:]}"


def _chain_svg(genesis: str, steps: list[dict[str, Any]]) -> str:
    nodes = [("genesis", genesis, None)] + [(f"step {s['step']}", s["checkpoint"], s["loss"]) for s in steps]
    per_row, w, h, gap = 6, 150, 58, 34
    rows = (len(nodes) + per_row - 1) // per_row
    width, height = per_row * (w + gap), rows * (h + gap) + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="checkpoint chain">',
             '<defs><marker id="arr" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
             '<path d="M0,0 L8,4 L0,8 z" fill="#7a86a8"/></marker></defs>']
    pos = []
    for i, (label, cid, loss) in enumerate(nodes):
        r, c = divmod(i, per_row)
        x, y = c * (w + gap) + 4, r * (h + gap) + 6
        pos.append((x, y))
        fill = "#eef2ff" if i else "#f3f4f6"
        parts.append(f'<g><title>{_e(cid)}</title><rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" stroke="#7a86a8"/>'
                     f'<text x="{x + 8}" y="{y + 18}" font-weight="600">{_e(label)}</text>'
                     f'<text x="{x + 8}" y="{y + 34}">{_e(_short(cid, 8))}</text>'
                     + (f'<text x="{x + 8}" y="{y + 50}" class="muted">eval loss {loss:.4f}</text>' if loss is not None else "")
                     + "</g>")
    for i in range(1, len(pos)):
        (x0, y0), (x1, y1) = pos[i - 1], pos[i]
        if y0 == y1:
            parts.append(f'<line x1="{x0 + w}" y1="{y0 + h / 2}" x2="{x1 - 2}" y2="{y1 + h / 2}" stroke="#7a86a8" marker-end="url(#arr)"/>')
        else:
            parts.append(f'<path d="M{x0 + w / 2},{y0 + h} C{x0 + w / 2},{y1 - 10} {x1 + w / 2},{y0 + h + 10} {x1 + w / 2},{y1 - 2}" fill="none" stroke="#7a86a8" marker-end="url(#arr)"/>')
    parts.append("</svg>")
    return "".join(parts)


def _curve_svg(steps: list[dict[str, Any]]) -> str:
    series = {
        "eval loss": ([s["step"] for s in steps if s["metrics"].get("eval_loss") is not None],
                      [s["metrics"]["eval_loss"] for s in steps if s["metrics"].get("eval_loss") is not None], "#3b5bdb"),
        "train loss": ([s["step"] for s in steps if s["metrics"].get("train_loss") is not None],
                       [s["metrics"]["train_loss"] for s in steps if s["metrics"].get("train_loss") is not None], "#e8590c"),
    }
    ys = [y for _, v, _ in series.values() for y in v]
    if not ys:
        return '<p class="muted">no metrics recorded</p>'
    W, H, L, B, T, Rm = 640, 260, 52, 30, 12, 110
    lo, hi = min(ys), max(ys)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    n = max(s["step"] for s in steps)
    sx = lambda x: L + (x - 1) / max(n - 1, 1) * (W - L - Rm)  # noqa: E731
    sy = lambda y: T + (hi - y) / (hi - lo) * (H - T - B)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" aria-label="loss curve">',
             f'<line x1="{L}" y1="{H - B}" x2="{W - Rm}" y2="{H - B}" stroke="#99a"/><line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="#99a"/>']
    for k in range(5):
        y = lo + (hi - lo) * k / 4
        parts.append(f'<text x="{L - 6}" y="{sy(y) + 4}" text-anchor="end">{y:.3f}</text>'
                     f'<line x1="{L}" y1="{sy(y)}" x2="{W - Rm}" y2="{sy(y)}" stroke="#eef"/>')
    for x in sorted({s["step"] for s in steps}):
        parts.append(f'<text x="{sx(x)}" y="{H - B + 16}" text-anchor="middle">{x}</text>')
    parts.append(f'<text x="{(L + W - Rm) / 2}" y="{H - 2}" text-anchor="middle" class="muted">outer step</text>')
    for i, (name, (xs, vs, color)) in enumerate(series.items()):
        if not xs:
            continue
        pts = " ".join(f"{sx(x):.1f},{sy(v):.1f}" for x, v in zip(xs, vs, strict=True))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(v):.1f}" r="3" fill="{color}"><title>{_e(name)} {v:.4f} at step {x}</title></circle>'
                  for x, v in zip(xs, vs, strict=True)]
        parts.append(f'<rect x="{W - Rm + 12}" y="{T + 18 * i}" width="12" height="3" fill="{color}"/>'
                     f'<text x="{W - Rm + 30}" y="{T + 18 * i + 5}">{_e(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(lineage: dict[str, Any]) -> str:
    """The report for `Lineage.as_json()`."""
    steps = lineage["steps"]
    cfg = lineage.get("config", {})
    job = cfg.get("job", {}) if isinstance(cfg, dict) else {}
    kv = [
        ("run id", lineage["run"]), ("job", lineage.get("name", "")), ("chain id", lineage["chain_id"]),
        ("ledger", lineage["ledger"]), ("registry", lineage.get("registry", "")),
        ("genesis", lineage["genesis"]), ("configuration", lineage.get("config_cid", "")),
        ("seed", job.get("seed", "")), ("corpus digest", cfg.get("corpus", "")), ("code hash", cfg.get("code", "")),
    ]
    for section in ("model", "parallel", "inner", "outer", "data"):
        if section in job:
            kv.append((section, ", ".join(f"{k}={v}" for k, v in job[section].items())))
    nodes: dict[str, dict[str, Any]] = {}
    for s in steps:
        for c in s["contributions"]:
            n = nodes.setdefault(c["node"], {"slots": set(), "losses": [], "count": 0})
            n["slots"].add((c["replica"], c["stage"]))
            n["losses"].append(c["loss"])
            n["count"] += 1
    for addr in lineage.get("stakes", {}):
        nodes.setdefault(addr, {"slots": set(), "losses": [], "count": 0})

    out = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>lineage: run {_e(lineage['run'])}</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>Run {_e(lineage['run'])} <span class=muted>{_e(lineage.get('name', ''))}</span></h1>",
           f'<p class=muted>{len(steps)} committed outer steps on chain {_e(lineage["chain_id"])}; every checkpoint '
           "below was read from the ledger's events and re-hashed against its stored block.</p>",
           "<h2>Checkpoint chain</h2>", _chain_svg(lineage["genesis"], steps),
           "<h2>Loss</h2>", _curve_svg(steps),
           "<h2>Nodes</h2><table><tr><th>node</th><th>stake (ETH)</th><th>slots (replica, stage)</th>"
           "<th>attestations</th><th>mean attested loss</th></tr>"]
    stakes = lineage.get("stakes", {})
    for addr, n in nodes.items():
        stake = int(stakes.get(addr, 0))
        mean = sum(n["losses"]) / len(n["losses"]) if n["losses"] else None
        out.append(f"<tr><td><code>{_e(addr)}</code></td><td>{stake / ETHER:g}</td>"
                   f"<td>{_e(', '.join(f'({r}, {s})' for r, s in sorted(n['slots'])))}</td><td>{n['count']}</td>"
                   f"<td>{'' if mean is None else f'{mean:.4f}'}</td></tr>")
    out.append("</table><h2>Steps</h2><table><tr><th>step</th><th>checkpoint / parent</th><th>eval loss</th>"
               "<th>contributions (replica, stage): node, CID, attested loss</th><th>transaction</th></tr>")
    for s in steps:
        contribs = "<br>".join(
            f"({c['replica']}, {c['stage']}) <code>{_e(c['node'][:10])}…</code> "
            f"<code title='{_e(c['cid'])}'>{_e(_short(c['cid']))}</code> {c['loss']:.4f}"
            for c in s["contributions"])
        loss = "" if s["loss"] is None else f"{s['loss']:.4f}"
        out.append(f"<tr><td>{s['step']}</td><td><code>{_e(s['checkpoint'])}</code><br>"
                   f"<span class=muted>parent <code>{_e(s['parent'])}</code></span></td><td>{loss}</td>"
                   f"<td class=c>{contribs}</td><td><code title='{_e(s['tx'])}'>{_e(_short(s['tx'], 12))}</code><br><span class=muted>block {s['block']}</span></td></tr>")
    out.append("</table><h2>Configuration</h2><table class=kv>")
    out += [f"<tr><td>{_e(k)}</td><td><code>{_e(v)}</code></td></tr>" for k, v in kv]
    out.append("</table></body></html>\n")
    return "".join(out)
