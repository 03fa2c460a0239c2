"""Latency against throughput for one or more sweeps, as a PNG (matplotlib: the `plot` extra).

Left: TTFT, right: TPOT; x is output tokens per second; solid lines are medians, dashed p99;
each point is labelled with its load (concurrency or rate)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_sweeps(docs: list[tuple[str, dict[str, Any]]], path: str | Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plot needs matplotlib: pip install 'ringserve[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, doc in docs:
        points = doc["points"]
        x = [p["summary"]["output_throughput"] for p in points]
        for ax, key in zip(axes, ("ttft", "tpot"), strict=True):
            med = [p["summary"][key]["median"] for p in points]
            p99 = [p["summary"][key]["p99"] for p in points]
            (line,) = ax.plot(x, med, marker="o", label=f"{name} median")
            ax.plot(x, p99, linestyle="--", marker=".", color=line.get_color(), label=f"{name} p99")
            for xi, yi, p in zip(x, med, points, strict=True):
                load = p["load"]
                tag = load.get("concurrency") or load.get("request_rate")
                if yi is not None:
                    ax.annotate(str(tag), (xi, yi), textcoords="offset points", xytext=(4, 4),
                                fontsize=7, color=line.get_color())
    for ax, title in zip(axes, ("time to first token", "time per output token"), strict=True):
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.suptitle("latency against throughput (labels: concurrency or request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
