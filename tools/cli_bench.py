"""`mlxrt bench`, `bench-http` and `bench-hostile`: their parsers and runners.

`mlxrt bench` runs one mode: the first of `BENCH_MODES`' flags given picks its runner, none the
mlxrt-against-mlx-lm comparison. Each runner checks its subsets before anything loads, runs its
`tools/bench_*` module, prints that module's table and writes its JSON (`--json`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import anyio

from runtime.config import RuntimeConfig
from tools.bench_common import dump
from tools.cli_common import EXIT_OK, EXIT_USAGE, config_arg, with_model

BenchRunner = Callable[[argparse.Namespace, RuntimeConfig], int]


def add_bench_parsers(sub) -> None:
    """The `bench`, `bench-http` and `bench-hostile` subcommands, in that order."""
    for add in (_add_bench, _add_bench_http, _add_bench_hostile):
        add(sub)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="mlxrt vs mlx-lm on the same workloads")
    config_arg(bench, default="configs/bench.toml")
    bench.add_argument("--prompt-tokens", type=int, default=128)
    bench.add_argument("--new-tokens", type=int, default=64)
    bench.add_argument("--concurrency", default="1,8,16", help="comma-separated")
    bench.add_argument("--long-prompt-tokens", type=int, default=2048)
    bench.add_argument("--prefix-tokens", type=int, default=1024, help="shared prefix of the prefix-reuse workload")
    bench.add_argument("--repeats", type=int, default=5, help="runs per workload; medians are reported")
    bench.add_argument("--model", default=None, help="serve this model instead of the config's (a directory or builtin:<name>)")
    bench.add_argument("--workloads", default="concurrency,interference,constrained,prefix", help="comma-separated subset")
    bench.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    bench.add_argument(
        "--plot", dest="plot_dir", default=None, metavar="DIR", help="also draw the results as PNG charts in DIR (tokens/s and TTFT against concurrency)"
    )
    bench.add_argument("--text", default=None, help="cut prompts from this text file (tokenized by the model) instead of random token ids")
    _mode_flag(
        bench,
        "--real",
        "the real default model (or --model) on real text against mlx-lm: throughput, prompt-lookup on copy-heavy chats, KV-quant perplexity, JSON schema",
    )
    bench.add_argument("--real-workloads", default="throughput,lookup,perplexity,structured", help="with --real: comma-separated subset")
    _mode_flag(
        bench,
        "--speculative",
        "speculative decoding on against off (builtin:bench-spec drafted by builtin:bench-spec-draft; prompt lookup on builtin:bench-copy)",
    )
    bench.add_argument("--spec-workloads", default="single,lookup,concurrency,verify", help="with --speculative: comma-separated subset")
    _mode_flag(bench, "--adapters", "16 streams with 8 distinct LoRA adapters in one batch against 16 base streams, and adapter load time")
    _mode_flag(bench, "--profile", "where a decode step's time goes (forward by piece, sampling, the rest), mlxrt's engine against mlx-lm on one model object")
    bench.add_argument("--profile-steps", type=int, default=24, help="with --profile: decode steps timed per run")
    _mode_flag(bench, "--pool", "two models in one process: swap latency, and alternating streams under a one-model cap")
    _mode_flag(
        bench,
        "--kv",
        "float KV in rows and in blocks, 8-bit and 4-bit KV side by side: c1/c16 at 128 and 2,048 tokens, fidelity, agreement, admission, prefix sharing",
    )
    bench.add_argument("--kv-workloads", default="throughput,fidelity,agreement,admission,sharing", help="with --kv: comma-separated subset")
    bench.add_argument("--kv-formats", default="float,paged,int8,int4", help="with --kv: KV formats measured (comma-separated)")
    _mode_flag(
        bench,
        "--disk",
        "the prefix cache's disk tier: a 4,096-token prompt's TTFT cold, from RAM and from disk after a restart per KV format; write-through cost at 8 streams",
    )
    _mode_flag(
        bench,
        "--vision",
        "image requests (default model builtin:bench-idefics3): TTFT beside 8 decoding text rows, a repeated image from the prefix cache, 8 at once against mlx-vlm's batch_generate",
    )
    bench.add_argument("--vision-workloads", default="beside,repeat,batch", help="with --vision: comma-separated subset")
    _mode_flag(
        bench,
        "--denoise",
        "denoising requests (default model builtin:bench-diffusion-gemma): tokens/s and steps against mlx-vlm's loop, alone and 4 at once; an AR request's decode beside them",
    )
    bench.add_argument("--denoise-workloads", default="alone,together,beside", help="with --denoise: comma-separated subset")
    bench.add_argument("--disk-workloads", default="restart,writes", help="with --disk: comma-separated subset")
    bench.add_argument("--disk-formats", default="float,int8,int4", help="with --disk: KV formats measured (comma-separated)")
    _mode_flag(bench, "--distributed", "one process against 2-rank worlds (tensor, pipeline) on this machine: builtin:bench-qwen2 by default")
    bench.add_argument(
        "--peer",
        nargs="?",
        const="llama.cpp",
        choices=["llama.cpp"],
        default=False,  # off like the other modes' flags
        help="mlxrt serve --http against llama-server (built once if missing) on one GGUF (--model; default SmolLM2 Q4_1), alternating; c1 as a share of the bandwidth roofline",
    )
    bench.add_argument("--peer-concurrency", default="1,4,16", help="with --peer: concurrency levels (comma-separated)")
    bench.set_defaults(func=_bench)


def _mode_flag(parser: argparse.ArgumentParser, flag: str, help: str) -> None:
    """A mode of `mlxrt bench` (on/off); `BENCH_MODES` holds its runner."""
    parser.add_argument(flag, action="store_true", help=help)


def _add_bench_http(sub) -> None:
    bench_http = sub.add_parser("bench-http", help="TTFT over HTTP next to the Unix socket and in-process, one runtime")
    config_arg(bench_http, default="configs/tiny.toml")
    bench_http.add_argument("--model", default=None, help="serve this model instead of the config's (a directory or builtin:<name>)")
    bench_http.add_argument("--requests", type=int, default=50, help="timed requests per face")
    bench_http.add_argument("--prompt-tokens", type=int, default=128)
    bench_http.add_argument("--new-tokens", type=int, default=4)
    bench_http.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    bench_http.set_defaults(func=_bench_http)


def _add_bench_hostile(sub) -> None:
    bench = sub.add_parser("bench-hostile", help="a stream's decode rate beside each maximum-size hostile HTTP request ([limits])")
    config_arg(bench, default="configs/tiny.toml")
    bench.add_argument("--model", default=None, help="serve this model instead of the config's (a directory or builtin:<name>)")
    bench.add_argument("--stream-tokens", type=int, default=256, help="tokens the timed stream decodes")
    bench.add_argument("--rounds", type=int, default=2, help="alone / beside rounds per hostile")
    bench.add_argument("--hostiles", default=None, help="comma-separated subset (default: all)")
    bench.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    bench.set_defaults(func=_bench_hostile)


def _bench(args) -> int:
    config = RuntimeConfig.load(args.config)
    return bench_runner(args)(args, config)


def bench_runner(args: argparse.Namespace) -> BenchRunner:
    """The runner of the first mode flag set in `args`, else the mlx-lm comparison."""
    return next((run for flag, run in BENCH_MODES if getattr(args, flag)), _compare)


def _report(results: dict, table: Callable[[dict], str], json_path: str | None) -> int:
    print(table(results))
    dump(results, json_path)
    return EXIT_OK


def _unknown(command: str, what: str, chosen: tuple[str, ...], known: tuple[str, ...]) -> bool:
    """Whether `chosen` names anything outside `known` (said on stderr)."""
    unknown = set(chosen) - set(known)
    if unknown:
        print(f"{command}: unknown {what} {sorted(unknown)}; known: {', '.join(known)}", file=sys.stderr)
    return bool(unknown)


def _subset(value: str) -> tuple[str, ...]:
    return tuple(w for w in value.split(",") if w)


def _compare(args, config: RuntimeConfig) -> int:
    from tools.bench import BenchOptions, format_roofline, format_table, run_bench

    config = with_model(config, args.model)
    workloads = _subset(args.workloads)
    if _unknown("mlxrt bench", "workloads", workloads, BenchOptions.workloads):
        return EXIT_USAGE
    options = BenchOptions(
        workloads=workloads,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        concurrency=tuple(int(x) for x in args.concurrency.split(",")),
        long_prompt_tokens=args.long_prompt_tokens,
        prefix_tokens=args.prefix_tokens,
        repeats=args.repeats,
        text_path=args.text,
    )
    results = anyio.run(run_bench, config, options)
    print(format_table(results))
    if results.get("roofline"):
        print(format_roofline(results["roofline"]))
    print(json.dumps(results["ratios"], indent=2))
    dump(results, args.json_path)
    if args.plot_dir:
        from pathlib import Path

        from tools.plots import plot_bench

        for path in plot_bench(results, Path(args.plot_dir)):
            print(f"wrote {path}")
    return EXIT_OK


def _profile(args, config: RuntimeConfig) -> int:
    from tools.profile import ProfileOptions, format_profile, run_profile

    options = ProfileOptions(concurrency=tuple(int(x) for x in args.concurrency.split(",")), prompt_tokens=args.prompt_tokens, steps=args.profile_steps)
    return _report(anyio.run(run_profile, with_model(config, args.model), options), format_profile, args.json_path)


def _real(args, config: RuntimeConfig) -> int:
    from tools.bench_real import MODEL, WORKLOADS, RealBenchOptions, format_real_table, run_real_bench

    workloads = _subset(args.real_workloads)
    if _unknown("mlxrt bench --real", "workloads", workloads, WORKLOADS):
        return EXIT_USAGE
    options = RealBenchOptions(workloads=workloads, repeats=args.repeats, new_tokens=args.new_tokens)
    return _on_model(args, config, MODEL, run_real_bench, options, format_real_table)


def _speculative(args, config: RuntimeConfig) -> int:
    from tools.bench_spec import WORKLOADS, SpecBenchOptions, format_spec_table, run_spec_bench

    workloads = _subset(args.spec_workloads)
    if _unknown("mlxrt bench --speculative", "workloads", workloads, WORKLOADS):
        return EXIT_USAGE
    # The concurrency workload's levels beyond one stream (`single` is the one-stream workload).
    concurrency = tuple(n for n in (int(x) for x in args.concurrency.split(",")) if n > 1)
    options = SpecBenchOptions(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats, workloads=workloads, concurrency=concurrency)
    return _report(anyio.run(run_spec_bench, config, options), format_spec_table, args.json_path)


def _adapters(args, config: RuntimeConfig) -> int:
    from tools.bench_adapters import AdapterBenchOptions, format_adapter_table, run_adapter_bench

    options = AdapterBenchOptions(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats)
    return _report(anyio.run(run_adapter_bench, with_model(config, args.model), options), format_adapter_table, args.json_path)


def _pool(args, config: RuntimeConfig) -> int:
    from tools.bench_pool import PoolBenchOptions, format_pool_table, run_pool_bench

    options = PoolBenchOptions(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats)
    return _report(anyio.run(run_pool_bench, with_model(config, args.model), options), format_pool_table, args.json_path)


def _kv(args, config: RuntimeConfig) -> int:
    from tools.bench_kv import FORMATS, WORKLOADS, KvBenchOptions, format_kv_table, run_kv_bench

    workloads, formats = _subset(args.kv_workloads), _subset(args.kv_formats)
    if _unknown("mlxrt bench --kv", "workloads", workloads, WORKLOADS) or _unknown("mlxrt bench --kv", "formats", formats, tuple(FORMATS)):
        return EXIT_USAGE
    options = KvBenchOptions(formats=formats, new_tokens=args.new_tokens, repeats=min(args.repeats, 3), workloads=workloads)
    return _report(anyio.run(run_kv_bench, with_model(config, args.model), options), format_kv_table, args.json_path)


def _disk(args, config: RuntimeConfig) -> int:
    from tools.bench_disk import FORMATS, WORKLOADS, DiskBenchOptions, format_disk_table, run_disk_bench

    workloads, formats = _subset(args.disk_workloads), _subset(args.disk_formats)
    if set(workloads) - set(WORKLOADS) or set(formats) - set(FORMATS):
        print(f"mlxrt bench --disk: workloads are {', '.join(WORKLOADS)}; formats {', '.join(FORMATS)}", file=sys.stderr)
        return EXIT_USAGE
    options = DiskBenchOptions(formats=formats, repeats=min(args.repeats, 3), write_repeats=args.repeats, workloads=workloads)
    return _report(anyio.run(run_disk_bench, with_model(config, args.model), options), format_disk_table, args.json_path)


def _vision(args, config: RuntimeConfig) -> int:
    from tools.bench_vision import DEFAULT_MODEL, WORKLOADS, VisionBenchOptions, format_vision_table, run_vision_bench

    workloads = _subset(args.vision_workloads)
    if _unknown("mlxrt bench --vision", "workloads", workloads, WORKLOADS):
        return EXIT_USAGE
    options = VisionBenchOptions(workloads=workloads, repeats=min(args.repeats, 3), new_tokens=args.new_tokens)
    return _on_model(args, config, DEFAULT_MODEL, run_vision_bench, options, format_vision_table)


def _denoise(args, config: RuntimeConfig) -> int:
    from tools.bench_denoise import DEFAULT_MODEL, WORKLOADS, DenoiseBenchOptions, format_denoise_table, run_denoise_bench

    workloads = _subset(args.denoise_workloads)
    if _unknown("mlxrt bench --denoise", "workloads", workloads, WORKLOADS):
        return EXIT_USAGE
    options = DenoiseBenchOptions(workloads=workloads, repeats=min(args.repeats, 3), new_tokens=args.new_tokens)
    return _on_model(args, config, DEFAULT_MODEL, run_denoise_bench, options, format_denoise_table)


def _on_model(args, config: RuntimeConfig, default_model: str, run, options, table) -> int:
    """A bench of one model (`--model`, else the bench's own), reported as a table (and JSON)."""
    return _report(anyio.run(run, with_model(config, args.model or default_model), options), table, args.json_path)


def _peer(args, config: RuntimeConfig) -> int:
    """Two server processes: `mlxrt serve` reads `--config` itself."""
    from tools.bench_peer import run_from_args

    levels = args.peer_concurrency.split(",")
    if not all(level.isdigit() and int(level) > 0 for level in levels):
        print(f"mlxrt bench --peer: --peer-concurrency takes positive integers, got {args.peer_concurrency!r}", file=sys.stderr)
        return EXIT_USAGE
    return run_from_args(args)


def _world(args, config: RuntimeConfig) -> int:
    """Worlds of server processes, each with its own config: `config` is not used."""
    from tools.bench_world import WorldBenchOptions, format_world_table, run_world_bench

    concurrency = max(int(c) for c in args.concurrency.split(",") if c)
    options = WorldBenchOptions(model=args.model or WorldBenchOptions.model, concurrency=concurrency, new_tokens=args.new_tokens, repeats=min(args.repeats, 3))
    return _report(anyio.run(run_world_bench, options), format_world_table, args.json_path)


# `mlxrt bench`'s modes, by the flag that picks each; the first flag given wins.
BENCH_MODES: tuple[tuple[str, BenchRunner], ...] = (
    ("real", _real),
    ("speculative", _speculative),
    ("adapters", _adapters),
    ("pool", _pool),
    ("kv", _kv),
    ("disk", _disk),
    ("vision", _vision),
    ("denoise", _denoise),
    ("distributed", _world),
    ("profile", _profile),
    ("peer", _peer),
)


def _bench_http(args) -> int:
    from tools.bench_http import HttpBenchOptions, format_http_table, run_http_bench

    config = with_model(RuntimeConfig.load(args.config), args.model)
    options = HttpBenchOptions(requests=args.requests, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    return _report(anyio.run(run_http_bench, config, options), format_http_table, args.json_path)


def _bench_hostile(args) -> int:
    from tools.bench_hostile import HOSTILES, HostileBenchOptions, format_hostile_table, run_hostile_bench

    config = with_model(RuntimeConfig.load(args.config), args.model)
    hostiles = tuple(args.hostiles.split(",")) if args.hostiles else HOSTILES
    if _unknown("mlxrt bench-hostile", "hostiles", hostiles, HOSTILES):
        return EXIT_USAGE
    options = HostileBenchOptions(stream_tokens=args.stream_tokens, rounds=args.rounds, hostiles=hostiles)
    return _report(anyio.run(run_hostile_bench, config, options), format_hostile_table, args.json_path)
