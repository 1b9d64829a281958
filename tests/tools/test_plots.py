"""`mlxrt bench --plot`: the charts of a benchmark's results are written as PNGs, levels are read
from the `c<n>` entries alone, and results without any level are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.cli import _parser
from tools.plots import plot_bench

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _summary(n: int, scale: float) -> dict:
    """A `Run.summary()` of `n` streams."""
    return {
        "requests": n,
        "tokens": 64 * n,
        "throughput_tok_s": scale * 40.0 * n**0.8,
        "decode_tok_s_per_stream": scale * 40.0,
        "ttft_p50_s": 0.02 * n,
        "ttft_p99_s": 0.03 * n,
    }


def _results() -> dict:
    """What `run_bench` returns, with a level (c32) only mlxrt ran and workloads that are not levels."""
    return {
        "options": {"concurrency": [1, 8, 16, 32]},
        "model": {"path": "builtin:tiny", "type": "llama"},
        "mlxrt": {
            **{f"c{n}": _summary(n, 1.5) for n in (1, 8, 16, 32)},
            "interference": {"short_ttft_s": 0.1, "arrival_s": 0.05},
            "constrained_c8": _summary(8, 1.2),
            "prefix_reuse": {"cold_ttft_s": 0.2, "warm_ttft_s": 0.05, "warm_over_cold": 0.25},
        },
        "mlx_lm": {
            **{f"c{n}": _summary(n, 1.0) for n in (1, 8, 16)},
            "interference": {"short_ttft_s": 0.4},
        },
        "ratios": {"c1": 1.5},
    }


def test_both_charts_are_written_as_pngs(tmp_path: Path):
    directory = tmp_path / "charts" / "run"  # missing, parents included

    written = plot_bench(_results(), directory)

    assert written == [directory / "throughput.png", directory / "ttft.png"]
    assert sorted(directory.iterdir()) == sorted(written)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        assert len(data) > 5_000


def test_one_stack_alone_is_plotted(tmp_path: Path):
    results = _results()
    del results["mlx_lm"]

    assert [p.name for p in plot_bench(results, tmp_path)] == ["throughput.png", "ttft.png"]


def test_results_without_a_concurrency_level_are_refused(tmp_path: Path):
    results = _results()
    for stack in ("mlxrt", "mlx_lm"):
        results[stack] = {k: v for k, v in results[stack].items() if not (k[0] == "c" and k[1:].isdigit())}

    with pytest.raises(ValueError, match="no concurrency level"):
        plot_bench(results, tmp_path / "charts")
    assert not (tmp_path / "charts").exists()


def test_bench_takes_a_plot_directory():
    assert _parser().parse_args(["bench", "--plot", "charts"]).plot_dir == "charts"
    assert _parser().parse_args(["bench"]).plot_dir is None
