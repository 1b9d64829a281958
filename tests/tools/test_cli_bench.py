"""`mlxrt bench`'s modes: every mode flag of the parser has a runner in `BENCH_MODES` (a flag
without one would silently run the mlx-lm comparison), the first flag in table order wins, and
each mode refuses an unknown subset with exit 2 before any model loads."""

from __future__ import annotations

import argparse

import pytest

from tools.cli import main
from tools.cli_bench import BENCH_MODES, add_bench_parsers, bench_runner

TINY = "configs/tiny.toml"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mlxrt")
    add_bench_parsers(parser.add_subparsers(required=True))
    return parser.parse_args(argv)


def test_every_mode_flag_of_the_parser_has_a_runner_and_picks_it():
    modes = dict(BENCH_MODES)
    flags = [name for name, value in vars(_parse("bench")).items() if value is False]  # the on/off options
    assert sorted(flags) == sorted(modes)
    for flag, runner in modes.items():
        assert bench_runner(_parse("bench", f"--{flag}")) is runner, flag
    assert bench_runner(_parse("bench")) not in modes.values()


def test_with_several_mode_flags_the_first_in_table_order_wins_whatever_the_argument_order():
    assert [flag for flag, _ in BENCH_MODES] == ["real", "speculative", "adapters", "pool", "kv", "disk", "vision", "denoise", "distributed", "profile", "peer"]
    modes = dict(BENCH_MODES)
    assert bench_runner(_parse("bench", "--profile", "--kv", "--speculative")) is modes["speculative"]
    assert bench_runner(_parse("bench", "--profile", "--distributed")) is modes["distributed"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--workloads", "concurrency,nope"], "mlxrt bench: unknown workloads ['nope']; known: concurrency,"),
        (["--real", "--real-workloads", "nope"], "mlxrt bench --real: unknown workloads ['nope']; known: throughput,"),
        (["--speculative", "--spec-workloads", "nope"], "mlxrt bench --speculative: unknown workloads ['nope']; known: single,"),
        (["--kv", "--kv-workloads", "nope"], "mlxrt bench --kv: unknown workloads ['nope']; known: throughput,"),
        (["--kv", "--kv-formats", "int3"], "mlxrt bench --kv: unknown formats ['int3']; known: float, paged, int8, int4"),
        (["--disk", "--disk-formats", "int3"], "mlxrt bench --disk: workloads are restart, writes; formats float, int8, int4"),
        (["--vision", "--vision-workloads", "nope"], "mlxrt bench --vision: unknown workloads ['nope']; known: beside, repeat, batch"),
        (["--denoise", "--denoise-workloads", "nope"], "mlxrt bench --denoise: unknown workloads ['nope']; known: alone, together, beside"),
    ],
)
def test_an_unknown_subset_exits_2_naming_the_known_ones(argv, said, capsys):
    assert main(["bench", "--config", TINY, *argv]) == 2
    assert said in capsys.readouterr().err


def test_an_unknown_hostile_exits_2():
    assert main(["bench-hostile", "--config", TINY, "--hostiles", "n,nope"]) == 2


def test_the_c1_roofline_is_the_rate_over_bandwidth_per_bytes_a_token():
    from tools.bench import BenchOptions, c1_roofline, format_roofline

    options = BenchOptions(prompt_tokens=100, new_tokens=20)
    c1 = {"decode_tok_s_per_stream": 30.0}
    # 1,000,000 weight bytes + 1,000 a position at 110 positions on average: 1.11 MB a token.
    line = c1_roofline(c1, 1_000_000, 1_000, options, [55.5e6, 111e6])
    assert line is not None and line["bytes_per_token"] == 1_110_000
    assert line["roofline_tok_s"] == pytest.approx([50.0, 100.0])
    assert line["fraction"] == pytest.approx([0.6, 0.3])
    assert "= 60.0% / 30.0% of 50.0 / 100.0 tok/s" in format_roofline(line)
    # No fixed weight bytes (a mixture of experts) or no c1 run: no line.
    assert c1_roofline(c1, 0, 1_000, options, [1e9]) is None and c1_roofline(None, 1, 1, options, [1e9]) is None
