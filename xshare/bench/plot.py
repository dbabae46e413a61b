"""The benchmark's figure: one row per workload, bars per mode for aggregate steps/s, peak
memory and average JCT, each bar labelled with its ratio to ``exclusive``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

_PANELS = (("steps_per_s", "aggregate steps/s (higher is better)", 1.0),
           ("peak_rss_bytes", "peak memory, MiB (lower is better)", 2 ** 20),
           ("avg_jct_s", "average JCT, s (lower is better)", 1.0))


def _color(mode: str) -> str:
    if mode == "exclusive":
        return "#7f7f7f"
    if mode == "processes":
        return "#d62728"
    if mode == "threads":
        return "#ff7f0e"
    return {"xshare:pack": "#1f77b4", "xshare:fifo": "#9ecae1", "xshare:srtf": "#2ca02c",
            "xshare:fair": "#17becf"}.get(mode, "#1f77b4")


def plot(results: Mapping[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(results["workloads"].values())
    rows = max(len(workloads), 1)
    fig, axes = plt.subplots(rows, len(_PANELS), figsize=(5.2 * len(_PANELS), 3.6 * rows), squeeze=False)
    for r, wl in enumerate(workloads):
        modes = list(wl["modes"])
        for c, (key, title, scale) in enumerate(_PANELS):
            ax = axes[r][c]
            values = [(wl["modes"][m]["median"].get(key) or 0) / scale for m in modes]
            bars = ax.bar(range(len(modes)), values, color=[_color(m) for m in modes])
            if key == "peak_rss_bytes":  # PSS (shared pages split) drawn inside the RSS bar
                pss = [(wl["modes"][m]["median"].get("peak_pss_bytes") or 0) / scale for m in modes]
                ax.bar(range(len(modes)), pss, width=0.45, color="white", alpha=0.55, hatch="//",
                       edgecolor="black", linewidth=0.4, label="PSS")
                ax.legend(loc="upper left", fontsize=7, frameon=False)
            for i, (bar, mode) in enumerate(zip(bars, modes)):
                ratio = (wl["modes"][mode].get("ratio_to_exclusive") or {}).get(key)
                label = "" if ratio is None else f"{ratio:.2f}x"
                ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
            ax.set_xticks(range(len(modes)))
            ax.set_xticklabels([m.replace("xshare:", "xs:") for m in modes], rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{wl['name']}: {title}", fontsize=9)
            ax.margins(y=0.15)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"xshare bench ({results['date']}, {results['machine']['cpu']}, "
                 f"{results['machine']['logical_cores']} cores); labels: ratio to exclusive", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
