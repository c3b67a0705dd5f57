"""A run's lineage as one self-contained HTML file (`dlx lineage --html FILE`).

No scripts, no external assets: inline CSS and SVG only, so the file can be archived or
mailed next to the run and opened anywhere. It shows the checkpoint chain as a graph
(branches rejected by an upheld challenge below it, in red), the loss curves (outer, and
inner per step where the run directory's metrics.jsonl is at hand), bytes sent and
compression error per step, each node's stake and contributions, and every step's status
and transaction. `render_compare_html` puts two runs side by side (`dlx lineage compare`):
the configuration keys that differ and their curves on shared axes.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

ETHER = 10**18
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1d2330;padding:0 1em}
h1{font-size:1.5em;margin-bottom:.2em}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #dde}
table{border-collapse:collapse;width:100%;font-size:12.5px}th,td{padding:4px 8px;border-bottom:1px solid #eef;text-align:left;vertical-align:top}
th{background:#f4f6fb}code{font:12px ui-monospace,monospace}.muted{color:#667}.kv td:first-child{width:14em;color:#556}
svg text{font:11px system-ui,sans-serif}td code{word-break:break-all}td.c{white-space:nowrap}.ok{color:#17803d}.bad{color:#b42318}
.scroll{overflow-x:auto}tr.rejected td{background:#fdecea}tr.rejected td:not(.st){text-decoration:line-through;text-decoration-color:#b4231880}
td.st.rejected{color:#b42318;font-weight:600}td.st.finalized{color:#17803d}td.st.uncommitted{color:#b26b00}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _short(cid: str, n: int = 10) -> str:
    return cid if len(cid) <= 2 * n else f"{cid[:n]}…{cid[-6:]}"


def _lanes(steps: list[dict[str, Any]]) -> list[int]:
    """The lane of each step in the graph: 0 for the current chain, then one lane per
    branch an upheld challenge cut off (its steps share the challenge id)."""
    branches: dict[Any, int] = {}
    lanes = []
    for s in steps:
        if s.get("status") == "rejected":
            lanes.append(branches.setdefault(s.get("rejected_by"), len(branches) + 1))
        else:
            lanes.append(0)
    return lanes


def _replicas(step: dict[str, Any]) -> str:
    """A step's replica set as the report prints it: `0,2` (empty for older lineages)."""
    return ",".join(map(str, step.get("replicas", [])))


def _chain_svg(genesis: str, steps: list[dict[str, Any]]) -> str:
    """Checkpoints as boxes, one column per step, an arrow from each parent to its child;
    branches rejected by a challenge run below the current chain, in red. Each box names
    the replicas that took part in its step."""
    w, h, gx, gy = 140, 76, 34, 26
    lanes = _lanes(steps)
    nodes = [("genesis", genesis, None, "genesis", 0, 0, "")] + [
        (f"step {s['step']}", s["checkpoint"], s["loss"], s.get("status", "pending"), s["step"], lane, _replicas(s))
        for s, lane in zip(steps, lanes, strict=True)]
    cols = max(n[4] for n in nodes) + 1
    width, height = cols * (w + gx) + 8, (max(lanes, default=0) + 1) * (h + gy) + 12
    fills = {"genesis": ("#f3f4f6", "#7a86a8"), "finalized": ("#e6f4ea", "#17803d"),
             "pending": ("#eef2ff", "#7a86a8"), "rejected": ("#fdecea", "#b42318"),
             "uncommitted": ("#fff7e6", "#b26b00")}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" aria-label="checkpoint chain">',
             '<defs><marker id="arr" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
             '<path d="M0,0 L8,4 L0,8 z" fill="#7a86a8"/></marker></defs>']
    pos: dict[str, tuple[float, float]] = {}
    boxes = []
    for label, cid, loss, status, col, lane, replicas in nodes:
        x, y = col * (w + gx) + 4, lane * (h + gy) + 6
        fill, stroke = fills.get(status, fills["pending"])
        dash = ' stroke-dasharray="5 3"' if status in ("rejected", "uncommitted") else ""
        boxes.append(f'<g class="ckpt {status}"><title>{_e(cid)} ({_e(status)})</title>'
                     f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" stroke="{stroke}"{dash}/>'
                     f'<text x="{x + 8}" y="{y + 16}" font-weight="600">{_e(label)}'
                     + (f' <tspan fill="{stroke}">{_e(status)}</tspan>' if status != "genesis" else "") + "</text>"
                     f'<text x="{x + 8}" y="{y + 33}">{_e(_short(cid, 8))}</text>'
                     + (f'<text x="{x + 8}" y="{y + 50}" class="muted">eval loss {loss:.4f}</text>' if loss is not None else "")
                     + (f'<text x="{x + 8}" y="{y + 67}" class="replicas">replicas {_e(replicas)}</text>' if replicas else "")
                     + "</g>")
        pos[cid] = (x, y)
    for s in steps:
        if s["parent"] not in pos:
            continue
        (x0, y0), (x1, y1) = pos[s["parent"]], pos[s["checkpoint"]]
        if y0 == y1:
            parts.append(f'<line x1="{x0 + w}" y1="{y0 + h / 2}" x2="{x1 - 2}" y2="{y1 + h / 2}" stroke="#7a86a8" marker-end="url(#arr)"/>')
        else:
            parts.append(f'<path d="M{x0 + w},{y0 + h / 2} C{x0 + w + gx},{y0 + h / 2} {x1 - gx},{y1 + h / 2} {x1 - 2},{y1 + h / 2}" '
                         'fill="none" stroke="#7a86a8" marker-end="url(#arr)"/>')
    parts += boxes
    parts.append("</svg>")
    return "".join(parts)


def _curve_svg(all_steps: list[dict[str, Any]]) -> str:
    """Eval and train loss per outer step; rejected steps' eval loss as hollow red marks."""
    steps = [s for s in all_steps if s.get("status") != "rejected"] or all_steps
    rejected = [(s["step"], s["metrics"]["eval_loss"]) for s in all_steps
                if s.get("status") == "rejected" and s["metrics"].get("eval_loss") is not None]
    series = {"eval loss": (_metric(steps, "eval_loss"), "#3b5bdb"),
              "train loss": (_metric(steps, "train_loss"), "#e8590c")}
    return _plot_svg("loss curve", series, "outer step", marks=("rejected", rejected),
                     x_max=max((s["step"] for s in all_steps), default=1))


def _metric(steps: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(outer step, metric) of the steps that recorded `key`."""
    return [(s["step"], s["metrics"][key]) for s in steps if s["metrics"].get(key) is not None]


def _bytes(v: float) -> str:
    return f"{v / 1e6:.2f} MB"


def _plot_svg(label: str, series: dict[str, tuple[list[tuple[float, float]], str]], x_label: str, *,
              fmt: Callable[[float], str] = "{:.4f}".format, axis_fmt: Callable[[float], str] = "{:.3f}".format,
              marks: tuple[str, list[tuple[float, float]]] | None = None, x_max: float | None = None) -> str:
    """A line chart as inline SVG: one polyline per series (name -> ([(x, y)], colour)),
    each point a circle titled "<name> <y> at step <x>", a legend on the right, and
    optional hollow red `marks` (legend name, points). `label` is its aria-label."""
    mark_name, marked = marks or ("", [])
    ys = [y for pts, _ in series.values() for _, y in pts] + [y for _, y in marked]
    if not ys:
        return f'<p class="muted">no data for the {_e(label)}</p>'
    # The legend's column fits its longest name (about 7 px a character at the page's font
    # size), widening the chart rather than cutting the name off.
    names = [*series, *([mark_name] if marked else [])]
    Rm = max(120, 36 + 7 * max(map(len, names), default=0))
    W, H, L, B, T = 520 + Rm, 260, 64, 30, 12
    lo, hi = min(ys), max(ys)
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    xs_all = [x for pts, _ in series.values() for x, _ in pts] + [x for x, _ in marked]
    x0, n = min(xs_all), max(xs_all) if x_max is None else x_max
    sx = lambda x: L + (x - x0) / max(n - x0, 1) * (W - L - Rm)  # noqa: E731
    sy = lambda y: T + (hi - y) / (hi - lo) * (H - T - B)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" aria-label="{_e(label)}">',
             f'<line x1="{L}" y1="{H - B}" x2="{W - Rm}" y2="{H - B}" stroke="#99a"/><line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="#99a"/>']
    for k in range(5):
        y = lo + (hi - lo) * k / 4
        parts.append(f'<text x="{L - 6}" y="{sy(y) + 4}" text-anchor="end">{_e(axis_fmt(y))}</text>'
                     f'<line x1="{L}" y1="{sy(y)}" x2="{W - Rm}" y2="{sy(y)}" stroke="#eef"/>')
    span = int(n - x0) + 1
    stride = next(k * 10**e for e in range(12) for k in (1, 2, 5) if k * 10**e * 10 >= span)  # at most 10 labels
    for x in sorted({int(x0), *range(stride, int(n) + 1, stride)}):
        if x >= x0:
            parts.append(f'<text x="{sx(x)}" y="{H - B + 16}" text-anchor="middle">{x}</text>')
    parts.append(f'<text x="{(L + W - Rm) / 2}" y="{H - 2}" text-anchor="middle" class="muted">{_e(x_label)}</text>')
    drawn = 0
    for name, (pts, color) in series.items():
        if not pts:
            continue
        line = " ".join(f"{sx(x):.1f},{sy(v):.1f}" for x, v in pts)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(v):.1f}" r="3" fill="{color}"><title>{_e(name)} {_e(fmt(v))} at step {x:g}</title></circle>'
                  for x, v in pts]
        parts.append(f'<rect x="{W - Rm + 12}" y="{T + 18 * drawn}" width="12" height="3" fill="{color}"/>'
                     f'<text x="{W - Rm + 30}" y="{T + 18 * drawn + 5}">{_e(name)}</text>')
        drawn += 1
    for x, v in marked:
        parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(v):.1f}" r="4" fill="none" stroke="#b42318" stroke-width="2">'
                     f'<title>{_e(mark_name)} step {x:g}: {_e(fmt(v))}</title></circle>')
    if marked:
        parts.append(f'<circle cx="{W - Rm + 18}" cy="{T + 18 * drawn + 3}" r="4" fill="none" stroke="#b42318" stroke-width="2"/>'
                     f'<text x="{W - Rm + 30}" y="{T + 18 * drawn + 7}">{_e(mark_name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def committed_inner(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The inner-step lines of a run's metrics.jsonl on its committed path: those an
    abandoned attempt wrote past the step a resume started from (`"abandoned": true`) left
    out, and each inner step once (the last written), in inner-step order."""
    kept = {r["global_step"]: r for r in records if r.get("kind") == "inner" and not r.get("abandoned")}
    return [kept[k] for k in sorted(kept)]


def _training_plots(steps: list[dict[str, Any]], inner: list[dict[str, Any]] | None) -> str:
    """Inner loss per inner step (from the run's metrics.jsonl), bytes sent and
    compression error per outer step (from the manifests' metrics)."""
    live = [s for s in steps if s.get("status") != "rejected"]
    inner_pts = [(r["global_step"], r["loss"]) for r in committed_inner(inner or [])]
    return "".join([
        "<h2>Inner loss</h2>",
        _plot_svg("inner loss", {"inner loss (replica 0)": (inner_pts, "#0b7285")}, "inner step")
        if inner_pts else '<p class="muted">no inner-step metrics: the run directory has no metrics.jsonl</p>',
        "<h2>Bytes sent</h2>",
        _plot_svg("bytes sent", {"bytes sent (all ranks)": (_metric(live, "bytes_sent"), "#5f3dc4")}, "outer step",
                  fmt=_bytes, axis_fmt=_bytes),
        "<h2>Compression error</h2>",
        _plot_svg("compression error", {"relative error": (_metric(live, "rel_error"), "#c2255c")}, "outer step",
                  fmt="{:.4g}".format, axis_fmt="{:.3g}".format),
    ])


def _reward_html(lineage: dict[str, Any], step: dict[str, Any]) -> str:
    """A final step's reward cell (issue 35): the share a slot and who earned it, slot order
    ("forfeited": a node slashed after the step); empty for a step not final or unpaid."""
    reward = (lineage.get("rewards") or {}).get(str(step["step"]))
    if not reward or step.get("status") != "finalized":
        return ""
    share = int(reward["share_wei"])
    paid = "<br>".join(f"<code title='{_e(p)}'>{_e(p[:10])}…</code>" if p else "<span class=muted>forfeited</span>"
                       for p in reward["paid"])
    return f"<span class=reward>{share / ETHER:g} ETH a slot</span> ({share} wei) to<br>{paid}"


def render_html(lineage: dict[str, Any], inner: list[dict[str, Any]] | None = None) -> str:
    """The report for `Lineage.as_json()`; `inner`: the run's metrics.jsonl records, if known."""
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
            if c["node"] is None:  # an uncommitted checkpoint: nobody attested it
                continue
            n = nodes.setdefault(c["node"], {"slots": set(), "losses": [], "count": 0})
            n["slots"].add((c["replica"], c["stage"]))
            n["losses"].append(c["loss"])
            n["count"] += 1
    for addr in lineage.get("stakes", {}):
        nodes.setdefault(addr, {"slots": set(), "losses": [], "count": 0})

    counts = {st: sum(1 for s in steps if s.get("status") == st) for st in ("finalized", "pending", "rejected", "uncommitted")}
    summary = ", ".join(f"{n} {st}" for st, n in counts.items() if n) or "no steps"
    target = lineage.get("target")
    scope = (f"The ancestors of checkpoint <code>{_e(target)}</code>" if target
             else "Every commit of the run, in chain order,")
    out = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>lineage: run {_e(lineage['run'])}</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>Run {_e(lineage['run'])} <span class=muted>{_e(lineage.get('name', ''))}</span></h1>",
           f'<p class=muted>{scope} on chain {_e(lineage["chain_id"])} ({_e(summary)}); every checkpoint '
           "below was read from the ledger's events and re-hashed against its stored block. "
           "Steps rejected by an upheld challenge are marked in red.</p>",
           "<h2>Checkpoint chain</h2>", f"<div class=scroll>{_chain_svg(lineage['genesis'], steps)}</div>",
           "<h2>Loss</h2>", _curve_svg(steps), _training_plots(steps, inner),
           "<h2>Nodes</h2><table><tr><th>node</th><th>stake (ETH)</th><th>slots (replica, stage)</th>"
           "<th>attestations</th><th>mean attested loss</th></tr>"]
    stakes = lineage.get("stakes", {})
    for addr, n in nodes.items():
        stake = int(stakes.get(addr, 0))
        mean = sum(n["losses"]) / len(n["losses"]) if n["losses"] else None
        out.append(f"<tr><td><code>{_e(addr)}</code></td><td>{stake / ETHER:g}</td>"
                   f"<td>{_e(', '.join(f'({r}, {s})' for r, s in sorted(n['slots'])))}</td><td>{n['count']}</td>"
                   f"<td>{'' if mean is None else f'{mean:.4f}'}</td></tr>")
    out.append("</table><h2>Steps</h2><table><tr><th>step</th><th>status</th><th>replicas</th><th>checkpoint / parent</th><th>eval loss</th>"
               "<th>contributions (replica, stage): node, CID, attested loss</th><th>reward</th><th>transaction</th></tr>")
    for s in steps:
        contribs = "<br>".join(
            f"({c['replica']}, {c['stage']}) <code>{_e((c['node'] or 'unattested')[:10])}…</code> "
            + (f"<code title='{_e(c['cid'])}'>{_e(_short(c['cid']))}</code> " if c["cid"]
               else "<span class=muted>block not in the store</span> ")
            + f"{'' if c['loss'] is None else format(c['loss'], '.4f')}"
            for c in s["contributions"])
        loss = "" if s["loss"] is None else f"{s['loss']:.4f}"
        status = s.get("status", "pending")
        why = f" by challenge {s['rejected_by']}" if s.get("rejected_by") is not None else ""
        out.append(f"<tr class='{_e(status)}'><td>{s['step']}</td><td class='st {_e(status)}'>{_e(status)}{_e(why)}</td>"
                   f"<td class=replicas>{_e(_replicas(s))}</td><td><code>{_e(s['checkpoint'])}</code><br>"
                   f"<span class=muted>parent <code>{_e(s['parent'])}</code></span></td><td>{loss}</td>"
                   f"<td class=c>{contribs}</td><td class=c>{_reward_html(lineage, s)}</td><td><code title='{_e(s['tx'])}'>{_e(_short(s['tx'], 12))}</code><br><span class=muted>block {s['block']}</span></td></tr>")
    out.append("</table><h2>Configuration</h2><table class=kv>")
    out += [f"<tr><td>{_e(k)}</td><td><code>{_e(v)}</code></td></tr>" for k, v in kv]
    out.append("</table></body></html>\n")
    return "".join(out)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: nested job sections as dotted keys."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, value in A, value in B) for every configuration key two lineages
    (`Lineage.as_json()`) do not share, sorted; a key one run lacks has None there."""
    fa, fb = flatten(a.get("config") or {}), flatten(b.get("config") or {})
    return [(k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]


def render_compare_html(a: dict[str, Any], b: dict[str, Any], inner_a: list[dict[str, Any]] | None = None,
                        inner_b: list[dict[str, Any]] | None = None) -> str:
    """Two runs side by side: what differs in their configurations, then eval loss, inner
    loss, bytes sent and compression error of both on shared axes (A blue, B orange)."""
    names = {"A": f"A: run {a['run']} {a.get('name', '')}".rstrip(), "B": f"B: run {b['run']} {b.get('name', '')}".rstrip()}
    colors = {"A": "#3b5bdb", "B": "#e8590c"}
    runs = {"A": (a, inner_a), "B": (b, inner_b)}

    def live(doc: dict[str, Any]) -> list[dict[str, Any]]:
        return [s for s in doc["steps"] if s.get("status") != "rejected"]

    def outer(key: str) -> dict[str, tuple[list[tuple[float, float]], str]]:
        return {names[k]: (_metric(live(doc), key), colors[k]) for k, (doc, _) in runs.items()}

    inner = {names[k]: ([(r["global_step"], r["loss"]) for r in committed_inner(recs or [])], colors[k])
             for k, (_, recs) in runs.items()}
    out = [f"<!doctype html><html lang=en><head><meta charset=utf-8><title>compare: {_e(names['A'])} / {_e(names['B'])}</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>{_e(names['A'])} <span class=muted>vs</span> {_e(names['B'])}</h1>",
           "<h2>Configuration differences</h2>"]
    diffs = config_differences(a, b)
    if diffs:
        out.append("<table class=diff><tr><th>key</th><th>A</th><th>B</th></tr>")
        out += [f"<tr><td><code>{_e(k)}</code></td><td><code>{_e(va)}</code></td><td><code>{_e(vb)}</code></td></tr>"
                for k, va, vb in diffs]
        out.append("</table>")
    else:
        out.append("<p class=muted>the two configurations are identical</p>")
    out += ["<h2>Eval loss</h2>", _plot_svg("eval loss", outer("eval_loss"), "outer step"),
            "<h2>Inner loss</h2>", _plot_svg("inner loss", inner, "inner step"),
            "<h2>Bytes sent</h2>", _plot_svg("bytes sent", outer("bytes_sent"), "outer step", fmt=_bytes, axis_fmt=_bytes),
            "<h2>Compression error</h2>", _plot_svg("compression error", outer("rel_error"), "outer step",
                                                    fmt="{:.4g}".format, axis_fmt="{:.3g}".format),
            "</body></html>\n"]
    return "".join(out)
