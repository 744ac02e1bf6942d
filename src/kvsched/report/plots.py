"""The report's figures as PNG bytes (matplotlib, Agg, no timestamps: the same data gives the
same bytes). Each function draws one figure from `kvsched.report.folders` data."""
from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from kvsched.report.folders import Capacity, Curve, Run

STYLE = {"font.size": 10, "axes.titlesize": 11, "axes.grid": True, "grid.alpha": 0.3, "legend.fontsize": 9,
         "figure.dpi": 100, "savefig.dpi": 100, "svg.hashsalt": "kvsched", "path.simplify": True}
PANELS = [("median_ttft_ms", "median TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"),
          ("median_tpot_ms", "median TPOT (ms)"), ("p99_tpot_ms", "p99 TPOT (ms)")]
# per-tier panels: figure key, title, the tier's SLO (seconds) drawn over it, percent axis
TIER_PANELS = [("median_ttft_ms", "median TTFT (ms)", "ttft_slo_s", False),
               ("p99_itl_ms", "p99 ITL (ms)", "tbt_slo_s", False),
               ("ttft_slo_attainment", "requests meeting the TTFT SLO", None, True),
               ("tbt_slo_attainment", "requests meeting the TBT SLO", None, True),
               ("itl_slo_attainment", "gaps within the TBT SLO", None, True)]
TIER_KEYS = sorted({key for key, *_ in TIER_PANELS} | {"ttft_slo_s", "tbt_slo_s"}, key=lambda k: (-len(k), k))


def _figure(rows: int, cols: int, width: float, height: float) -> tuple[Figure, Any]:
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def _grid(n: int, row_height: float) -> tuple[Figure, Any]:
    """n panels, three to a row, the unused ones hidden."""
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = _figure(rows, cols, 11, row_height * rows + 0.6)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    return fig, axes


def png(fig: Figure) -> bytes:
    """PNG bytes without the Software/date metadata."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def style():
    """matplotlib's settings for the report, whatever the user's matplotlibrc says."""
    import matplotlib
    matplotlib.use("Agg")
    return matplotlib.rc_context(STYLE)


def palette(labels: Sequence[str]) -> dict[str, Any]:
    """One colour per label, the same in every figure."""
    from matplotlib import colormaps
    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(k % cmap.N) for k, label in enumerate(labels)}


def _legend(fig: Figure, axes: Any, n: int) -> None:
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat[1:]:            # labels only some panels carry (SLO lines)
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    fig.legend(handles, labels, loc="outside lower center", ncols=min(max(n, 1), 5), frameon=False)


def _log_if_wide(ax: Axes, values: list[float], axis: str = "y") -> None:
    """Log scale when the positive values span more than 30x (TTFT near saturation does)."""
    pos = [v for v in values if math.isfinite(v) and v > 0]
    if pos and max(pos) > 30 * min(pos):
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
        target = ax.yaxis if axis == "y" else ax.xaxis
        target.set_minor_formatter(NullFormatter())     # matplotlib's labelled minor ticks overlap
        if max(pos) <= 300 * min(pos):                  # a short span: label 1, 2, 5 x 10^k, plainly
            target.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))


def latency_throughput(curves: list[Curve], colors: dict[str, Any]) -> bytes:
    """Median and p99 TTFT and TPOT against achieved request throughput, a line per curve."""
    fig, axes = _figure(2, 2, 11, 7.5)
    for ax, (key, title) in zip(axes.flat, PANELS):
        for c in curves:
            ax.plot([p["request_throughput"] for p in c.points], [p[key] for p in c.points], marker="o",
                    markersize=4, color=colors[c.label], label=c.label)
        _log_if_wide(ax, [p[key] for c in curves for p in c.points])
        ax.margins(0.1)
        ax.set(title=title, xlabel="request throughput (req/s)", ylabel="ms")
    _legend(fig, axes, len(curves))
    return png(fig)


def distributions(runs: list[Run], colors: dict[str, Any]) -> bytes:
    """CDFs of TTFT and TPOT from the percentiles 0..100."""
    fig, axes = _figure(1, 2, 11, 4.5)
    for ax, attr, name in ((axes[0, 0], "ttft_q", "TTFT"), (axes[0, 1], "tpot_q", "TPOT")):
        for r in runs:
            q = getattr(r, attr)
            ax.plot(q, [k / (len(q) - 1) for k in range(len(q))], color=colors[r.label], label=r.label)
        _log_if_wide(ax, [v for r in runs for v in getattr(r, attr)], "x")
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms)", ylabel="share of requests", ylim=(0, 1.01))
    _legend(fig, axes, len(runs))
    return png(fig)


def timeline(runs: list[Run], colors: dict[str, Any]) -> bytes:
    """KV use (share of capacity) and queue length against simulated time."""
    fig, axes = _figure(2, 1, 11, 6)
    for r in runs:
        t = [row[0] for row in r.timeline]
        axes[0, 0].plot(t, [row[3] * 100 for row in r.timeline], color=colors[r.label], label=r.label, lw=1.2)
        axes[1, 0].plot(t, [row[1] for row in r.timeline], color=colors[r.label], lw=1.2)
    axes[0, 0].set(title="KV cache in use", ylabel="% of capacity", ylim=(0, 105))
    axes[1, 0].set(title="waiting requests (queue length)", ylabel="requests", xlabel="simulated time (s)")
    _legend(fig, axes, len(runs))
    return png(fig)


def capacity_bars(cap: Capacity, colors: dict[str, Any]) -> bytes:
    """Max rate per policy (mean over seeds, whiskers min..max) with the service rate mu."""
    fig, axes = _figure(1, 1, max(6.0, 1.4 * len(cap.policies) + 3), 4.5)
    ax = axes[0, 0]
    for k, p in enumerate(cap.policies):
        err = [[max(p.max_rate - p.max_rate_min, 0)], [max(p.max_rate_max - p.max_rate, 0)]]
        ax.bar(k, p.max_rate, yerr=err, capsize=6, color=colors[p.name], width=0.6)
        ax.annotate(f"{p.max_rate:.3g}\n({p.bounded_by})", (k, p.max_rate_max if math.isfinite(p.max_rate_max)
                    else 0), xytext=(0, 4), textcoords="offset points", ha="center", va="bottom", fontsize=9)
        if p.mu is not None:
            ax.hlines(p.mu, k - 0.4, k + 0.4, colors="black", linestyles="--",
                      label="mu (stability service rate)" if k == 0 else None)
    ax.set_xticks(range(len(cap.policies)), [p.name for p in cap.policies])
    ax.set(title="largest arrival rate meeting every SLO", ylabel="max rate (req/s)")
    ax.margins(y=0.2)
    if any(p.mu is not None for p in cap.policies):
        ax.legend(loc="upper right")
    return png(fig)


def slo_panels(cap: Capacity, colors: dict[str, Any]) -> bytes:
    """Each criterion's figure against the probed rate (per seed; met filled, unmet crossed),
    its bound as a horizontal line and each policy's max rate as a vertical one."""
    fig, axes = _grid(len(cap.limits), 4)
    for ax, limit in zip(axes.flat, cap.limits):
        for p in cap.policies:
            _slo_points(ax, p, limit.key, colors[p.name])
        ax.axhline(limit.bound, color="black", ls="--", lw=1, label="SLO bound")
        if limit.upper:
            _log_if_wide(ax, [_get(e.figures, limit.key) for p in cap.policies for e in p.evaluations] + [limit.bound])
        ax.set(title=limit.title, xlabel="arrival rate (req/s)", ylabel=limit.unit)
    axes.flat[0].plot([], [], "o", color="gray", label="met (a seed)")
    axes.flat[0].plot([], [], "x", color="gray", label="not met")
    axes.flat[0].plot([], [], ":", color="gray", label="max rate")
    _legend(fig, axes, len(cap.policies) + 4)
    return png(fig)


def _slo_points(ax: Axes, p: Any, key: str, color: Any) -> None:
    for met, marker in ((True, "o"), (False, "x")):
        es = [e for e in p.evaluations if e.met == met]
        ax.scatter([e.rate for e in es], [_get(e.figures, key) for e in es], marker=marker, color=color, s=22,
                   label=p.name if met else None)
    if math.isfinite(p.max_rate):
        ax.axvline(p.max_rate, color=color, ls=":", lw=1.2)


def _get(figures: dict, key: str) -> float:
    from kvsched.report.folders import number
    return number(figures.get(key))


def tier_figures(runs: list[Run]) -> dict[str, dict[str, dict[str, Any]]]:
    """{tier: {run label: {key: value}}} from the runs' flat `tier_<name>_<key>` figures."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        for name, value in r.figures.items():
            tier, key = _tier_key(name)
            if tier is not None:
                out.setdefault(tier, {}).setdefault(r.label, {})[key] = value
    return out


def _tier_key(name: str) -> tuple[Optional[str], str]:
    """'tier_free_p99_itl_ms' -> ('free', 'p99_itl_ms'); keys are matched whole, longest first,
    so tier names may hold underscores."""
    if name.startswith("tier_"):
        for key in TIER_KEYS:
            if name.endswith("_" + key) and len(name) > len(key) + 6:
                return name[5:-len(key) - 1], key
    return None, name


def tiers(runs: list[Run], colors: dict[str, Any]) -> Optional[bytes]:
    """Per tier, grouped bars per run of the tier figures there are, tier SLOs as black lines."""
    data = tier_figures(runs)
    panels = [p for p in TIER_PANELS if any(math.isfinite(_get(f, p[0])) for t in data.values() for f in t.values())]
    if not data or not panels:
        return None
    fig, axes = _grid(len(panels), 3.8)
    for ax, panel in zip(axes.flat, panels):
        _tier_panel(ax, data, runs, panel, colors)
    _legend(fig, axes, len(runs) + 1)
    return png(fig)


def _tier_panel(ax: Axes, data: dict, runs: list[Run], panel: tuple, colors: dict[str, Any]) -> None:
    key, title, slo_key, percent = panel
    names, width = list(data), 0.8 / max(len(runs), 1)
    scale = 100 if percent else 1
    for j, r in enumerate(runs):
        xs = [k - 0.4 + width * (j + 0.5) for k in range(len(names))]
        ax.bar(xs, [_get(data[t].get(r.label, {}), key) * scale for t in names], width=width,
               color=colors[r.label], label=r.label)
    label = "the tier's SLO"
    for k, t in enumerate(names):
        slo = next((_get(f, slo_key) for f in data[t].values() if slo_key and _get(f, slo_key) > 0), math.nan)
        if math.isfinite(slo):
            ax.hlines(slo * 1000, k - 0.45, k + 0.45, colors="black", linestyles="--", label=label)
            label = None
    ax.set_xticks(range(len(names)), names)
    ax.set(title=title, ylabel="%" if percent else "ms")
    if percent:
        ax.set_ylim(0, 105)
