"""`mlxrt bench-agent`: the command line of `tools.bench_agent` (a 20-turn coding-agent session
against mlx-lm's server and after a restart with the disk tier)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import anyio

from runtime.config import RuntimeConfig
from tools.cli_common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, config_arg, with_model


def add_bench_agent_parser(sub) -> None:
    from tools.bench_agent import SERVERS

    bench = sub.add_parser(
        "bench-agent",
        help="a 20-turn coding-agent session with tools over HTTP: per-turn TTFT and prefilled tokens, mlxrt beside mlx_lm.server and after a restart",
    )
    config_arg(bench)
    bench.add_argument("--model", default=None, help="serve this model instead of the config's (a GGUF file, a directory or builtin:<name>)")
    bench.add_argument("--turns", type=int, default=20, help="requests in the session (each the whole history so far)")
    bench.add_argument("--repeats", type=int, default=3, help="sessions per server (fresh servers each time); medians are reported")
    bench.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    bench.add_argument("--seed", type=int, default=0, help="the scripted session's seed (tool outputs)")
    bench.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated subset of {', '.join(SERVERS)}")
    bench.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    bench.set_defaults(func=bench_agent)


def bench_agent(args: argparse.Namespace) -> int:
    from tools.bench_agent import SERVERS, AgentBenchOptions, HttpStatusError, dump_agent, format_agent_table, run_agent_bench
    from tools.mlx_lm_server import MlxLmServerError

    servers = tuple(s for s in args.servers.split(",") if s)
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown or not servers or args.turns < 1 or args.repeats < 1 or args.max_tokens < 1:
        print(f"mlxrt bench-agent: --servers from {', '.join(SERVERS)} (got {unknown or 'none'}); --turns, --repeats, --max-tokens >= 1", file=sys.stderr)
        return EXIT_USAGE
    config = with_model(RuntimeConfig.load(args.config), args.model)
    options = AgentBenchOptions(turns=args.turns, repeats=args.repeats, max_tokens=args.max_tokens, seed=args.seed, servers=servers)
    model_dir = _mlx_lm_dir(config) if "mlx-lm" in servers else None
    try:
        results = anyio.run(run_agent_bench, config, options, model_dir)
    except Exception as exc:  # e.g. a turn over the model's context (fewer --turns), raised through task groups
        failure = _first(exc, (HttpStatusError, MlxLmServerError))
        if failure is None:
            raise
        print(f"mlxrt bench-agent: {failure}", file=sys.stderr)
        return EXIT_FAILURE
    print(format_agent_table(results))
    dump_agent(results, args.json_path)
    return EXIT_OK


def _first(exc: BaseException, kinds: tuple[type[Exception], ...]) -> BaseException | None:
    """`exc`, or the first exception of `kinds` inside it (exception groups opened)."""
    if isinstance(exc, kinds):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        return next((found for inner in exc.exceptions if (found := _first(inner, kinds)) is not None), None)
    return None


def _mlx_lm_dir(config: RuntimeConfig) -> Path:
    """mlx-lm's directory of the config's model (a GGUF file exported once), on an MLX thread."""
    from actors.mlx_thread import MlxThread
    from runtime import env
    from tools.mlx_lm_server import mlx_lm_model_dir

    async def export() -> Path:
        thread = MlxThread(name="mlx-export")
        thread.start()
        try:
            return await thread.run(lambda: mlx_lm_model_dir(config.model.path, root=env.home()))
        finally:
            await thread.stop()

    return anyio.run(export)
