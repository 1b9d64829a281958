"""PNG charts of `mlxrt bench` results (`mlxrt bench --plot DIR`): tokens/s and time to first
token against concurrency, mlxrt next to mlx-lm, so a run can be read at a glance."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# (key in the results, label on the charts, colour): the same colour for a stack on every chart.
STACKS = (("mlxrt", "mlxrt", "tab:blue"), ("mlx_lm", "mlx-lm", "tab:orange"))
_LEVEL = re.compile(r"c(\d+)")

Levels = list[tuple[int, dict]]


def _levels(runs: dict) -> Levels:
    """One stack's concurrency levels (keys `c<n>`) in order; other workloads are not levels."""
    found = [(int(m.group(1)), summary) for key, summary in runs.items() if (m := _LEVEL.fullmatch(key))]
    return sorted(found, key=lambda level: level[0])


def plot_bench(results: dict, directory: Path) -> list[Path]:
    """Write throughput.png and ttft.png for the results of `tools.bench.run_bench` into
    `directory` (created if missing) and return their paths. A level only one stack ran is
    drawn for that stack alone; results without any level raise ValueError."""
    levels = {key: _levels(results.get(key, {})) for key, _, _ in STACKS}
    if not any(levels.values()):
        raise ValueError("no concurrency level (a 'c<n>' entry) in the bench results: run the 'concurrency' workload to plot them")
    # Imported here so that importing this module stays cheap; Agg draws without a display.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    model = results.get("model", {}).get("path")
    title_end = f" — {Path(model).name}" if model else ""
    all_levels = sorted({n for runs in levels.values() for n, _ in runs})

    def chart(name: str, title: str, ylabel: str, draw: Callable[[Axes, Levels, str, str], None]) -> Path:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        try:
            for key, label, color in STACKS:
                if levels[key]:
                    draw(ax, levels[key], label, color)
            ax.set_xscale("log", base=2)
            ax.set_xticks(all_levels, labels=[str(n) for n in all_levels])
            ax.minorticks_off()
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.set_title(title + title_end)
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = directory / name
            fig.savefig(path, dpi=120)
        finally:
            plt.close(fig)
        return path

    def throughput(ax: Axes, runs: Levels, label: str, color: str) -> None:
        ax.plot([n for n, _ in runs], [s["throughput_tok_s"] for _, s in runs], marker="o", color=color, label=label)

    def ttft(ax: Axes, runs: Levels, label: str, color: str) -> None:
        xs = [n for n, _ in runs]
        ax.plot(xs, [s["ttft_p50_s"] * 1000 for _, s in runs], marker="o", color=color, label=f"{label} p50")
        ax.plot(xs, [s["ttft_p99_s"] * 1000 for _, s in runs], marker="s", linestyle="--", color=color, label=f"{label} p99")

    return [
        chart("throughput.png", "Throughput", "tokens/s", throughput),
        chart("ttft.png", "Time to first token", "TTFT (ms)", ttft),
    ]
