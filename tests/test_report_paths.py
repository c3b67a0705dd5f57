"""The report's charts (lineage/audit/report.py) as a reader sees them: a legend name is
never cut off by the chart's edge (issue 37, item 7: "inner loss (replic"), and the inner
loss chart draws only the committed path of a resumed run (item 5)."""

from __future__ import annotations

import re

from lineage.audit.report import _plot_svg, committed_inner


def test_a_long_legend_name_fits_inside_the_chart():
    name = "inner loss (replica 0) of the longest run name"
    svg = _plot_svg("x", {name: ([(1, 1.0), (2, 0.5)], "#000")}, "step")
    width = int(re.search(r'<svg [^>]*width="(\d+)"', svg)[1])
    x = float(re.search(rf'<text x="([\d.]+)"[^>]*>{re.escape(name)}</text>', svg)[1])
    assert x + 7 * len(name) <= width


def test_the_inner_loss_chart_skips_an_abandoned_attempts_rounds():
    lines = [{"kind": "inner", "step": t, "global_step": g, "loss": 1.0} for t, g in ((1, 1), (1, 2), (2, 3))]
    lines += [{"kind": "inner", "step": 3, "global_step": 5, "loss": 9.0, "abandoned": True},
              {"kind": "resume", "step": 2},
              {"kind": "inner", "step": 3, "global_step": 4, "loss": 0.5},
              {"kind": "inner", "step": 3, "global_step": 5, "loss": 0.4}]
    assert [(r["global_step"], r["loss"]) for r in committed_inner(lines)] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 0.5),
                                                                                (5, 0.4)]
