"""`mlxrt`: the command line.

Exit codes: 0 success; 1 runtime failure (or the server could not be reached);
2 usage or config error (including an unsafe or busy socket path);
3 request rejected (invalid, too large, busy).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys

import anyio
import msgspec

import runtime  # noqa: F401  (fast BLAS before mlx loads)
from net.socket_path import SocketPathError
from protocols.api import Finished, GenerateRequest
from runtime.config import RuntimeConfig
from runtime.errors import ConfigError, InvalidRequestError, MlxrtError, ServerBusyError
from tools.launch import launch, launched_rank
from tools.terminal import print_events, quiet, self_command, user_request

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_REJECTED = 0, 1, 2, 3
DEFAULT_CONFIG = "configs/default.toml"
DEMO_PROMPT = "Explain in three sentences why the sky is blue."
TRY_PROMPT = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, SocketPathError) as exc:
        print(f"mlxrt: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        print(f"mlxrt: cannot reach the server: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except MlxrtError as exc:
        print(f"mlxrt: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_REJECTED if isinstance(exc, (InvalidRequestError, ServerBusyError)) else EXIT_FAILURE
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxrt", description="Serve MLX language models to many concurrent clients.")
    sub = parser.add_subparsers(required=True)
    for add in (_add_serve, _add_launch, _add_client, _add_demo, _add_generate, _add_chat, _add_bench, _add_bench_http, _add_bench_hostile, _add_config):
        add(sub)
    return parser


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve the configured model on a Unix socket (and over HTTP)")
    _config_arg(serve)
    serve.add_argument("--socket", help="socket path (default: [server] socket, or a per-user runtime directory)")
    serve.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI-compatible HTTP API here (default: [server] http, off)")
    serve.add_argument("--model", help="override [model] path")
    serve.set_defaults(func=_serve)


def _add_launch(sub) -> None:
    launch = sub.add_parser("launch", help="serve one model sharded over several processes or hosts ([distributed], through mlx.launch)")
    _config_arg(launch)
    launch.add_argument("-n", "--ranks", type=int, default=2, help="processes on this machine (default 2; ignored with a hostfile)")
    launch.add_argument("--hostfile", default=None, help="mlx.launch's hostfile (default: [distributed] hostfile; none: this machine)")
    launch.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: flags for every rank's `mlxrt serve` (--socket, --http)")
    launch.set_defaults(func=_launch)


def _add_client(sub) -> None:
    client = sub.add_parser("client", help="stream one request from a running server")
    client.add_argument("--socket", default=None, help="server socket (default: MLXRT_SERVER_SOCKET or the default path)")
    client.add_argument("--resume", metavar="ID", help="continue a checkpointed request instead of starting one")
    _request_args(client, required=False)
    client.set_defaults(func=_client)


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="one streamed generation on the configured model, with timings")
    _config_arg(demo)
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.set_defaults(func=_demo)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="one generation, in-process (or through --socket)")
    _config_arg(gen)
    gen.add_argument("--socket", default=None, help="use a running server instead of loading the model here")
    _request_args(gen)
    gen.set_defaults(func=_generate)


def _add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="a conversation with the model on this terminal (in-process, or a server's --socket or --http)")
    _config_arg(chat)
    where = chat.add_mutually_exclusive_group()
    where.add_argument("--socket", default=None, help="talk to the server on this socket instead of loading the model here")
    where.add_argument("--http", default=None, metavar="URL", help="talk to this OpenAI-compatible server (e.g. http://127.0.0.1:8000)")
    chat.add_argument("--api-key", default=None, help="bearer key for --http (default: MLXRT_SERVER_API_KEY)")
    chat.add_argument("--model", default=None, help="in-process: serve this model instead of the config's")
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("--max-tokens", type=int, default=None)
    chat.add_argument("--temperature", type=float, default=0.2)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--verbose", action="store_true", help="after each answer: prompt, cached and generated tokens, speed; and the runtime's info logs")
    chat.set_defaults(func=_chat)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="mlxrt vs mlx-lm on the same workloads")
    _config_arg(bench, default="configs/bench.toml")
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
    bench.add_argument(
        "--real",
        action="store_true",
        help="the real default model (or --model) on real text against mlx-lm: throughput, prompt-lookup on copy-heavy chats, KV-quant perplexity, JSON schema",
    )
    bench.add_argument("--real-workloads", default="throughput,lookup,perplexity,structured", help="with --real: comma-separated subset")
    bench.add_argument(
        "--speculative",
        action="store_true",
        help="speculative decoding on against off (builtin:bench-spec drafted by builtin:bench-spec-draft; prompt lookup on builtin:bench-copy)",
    )
    bench.add_argument("--spec-workloads", default="single,lookup,concurrency,verify", help="with --speculative: comma-separated subset")
    bench.add_argument(
        "--adapters", action="store_true", help="16 streams with 8 distinct LoRA adapters in one batch against 16 base streams, and adapter load time"
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="where a decode step's time goes (forward by piece, sampling, the rest), mlxrt's engine against mlx-lm on one model object",
    )
    bench.add_argument("--profile-steps", type=int, default=24, help="with --profile: decode steps timed per run")
    bench.add_argument("--pool", action="store_true", help="two models in one process: swap latency, and alternating streams under a one-model cap")
    bench.add_argument(
        "--kv",
        action="store_true",
        help="float KV in rows and in blocks, 8-bit and 4-bit KV side by side: c1/c16 at 128 and 2,048 tokens, fidelity, agreement, admission, prefix sharing",
    )
    bench.add_argument("--kv-workloads", default="throughput,fidelity,agreement,admission,sharing", help="with --kv: comma-separated subset")
    bench.add_argument("--kv-formats", default="float,paged,int8,int4", help="with --kv: KV formats measured (comma-separated)")
    bench.add_argument(
        "--disk",
        action="store_true",
        help="the prefix cache's disk tier: a 4,096-token prompt's TTFT cold, from RAM and from disk after a restart per KV format; write-through cost at 8 streams",
    )
    bench.add_argument(
        "--vision",
        action="store_true",
        help="image requests (default model builtin:bench-idefics3): TTFT beside 8 decoding text rows, a repeated image from the prefix cache, 8 at once against mlx-vlm's batch_generate",
    )
    bench.add_argument("--vision-workloads", default="beside,repeat,batch", help="with --vision: comma-separated subset")
    bench.add_argument(
        "--denoise",
        action="store_true",
        help="denoising requests (default model builtin:bench-diffusion-gemma): tokens/s and steps against mlx-vlm's loop, alone and 4 at once; an AR request's decode beside them",
    )
    bench.add_argument("--denoise-workloads", default="alone,together,beside", help="with --denoise: comma-separated subset")
    bench.add_argument("--disk-workloads", default="restart,writes", help="with --disk: comma-separated subset")
    bench.add_argument("--disk-formats", default="float,int8,int4", help="with --disk: KV formats measured (comma-separated)")
    bench.add_argument(
        "--distributed", action="store_true", help="one process against 2-rank worlds (tensor, pipeline) on this machine: builtin:bench-qwen2 by default"
    )
    bench.set_defaults(func=_bench)


def _add_bench_http(sub) -> None:
    bench_http = sub.add_parser("bench-http", help="TTFT over HTTP next to the Unix socket and in-process, one runtime")
    _config_arg(bench_http, default="configs/tiny.toml")
    bench_http.add_argument("--model", default=None, help="serve this model instead of the config's (a directory or builtin:<name>)")
    bench_http.add_argument("--requests", type=int, default=50, help="timed requests per face")
    bench_http.add_argument("--prompt-tokens", type=int, default=128)
    bench_http.add_argument("--new-tokens", type=int, default=4)
    bench_http.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    bench_http.set_defaults(func=_bench_http)


def _add_bench_hostile(sub) -> None:
    bench = sub.add_parser("bench-hostile", help="a stream's decode rate beside each maximum-size hostile HTTP request ([limits])")
    _config_arg(bench, default="configs/tiny.toml")
    bench.add_argument("--model", default=None, help="serve this model instead of the config's (a directory or builtin:<name>)")
    bench.add_argument("--stream-tokens", type=int, default=256, help="tokens the timed stream decodes")
    bench.add_argument("--rounds", type=int, default=2, help="alone / beside rounds per hostile")
    bench.add_argument("--hostiles", default=None, help="comma-separated subset (default: all)")
    bench.add_argument("--json", dest="json_path", default=None, help="also write the results here")
    bench.set_defaults(func=_bench_hostile)


def _add_config(sub) -> None:
    config = sub.add_parser("config", help="show or check configuration")
    config_sub = config.add_subparsers(required=True)
    show = config_sub.add_parser("show", help="the effective config, defaults filled in")
    _config_arg(show)
    show.set_defaults(func=_config_show)
    check = config_sub.add_parser("check", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(func=_config_check)


def _config_arg(parser: argparse.ArgumentParser, default: str = DEFAULT_CONFIG) -> None:
    parser.add_argument("--config", default=default, help=f"TOML config file (default: {default})")


def _request_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    prompt = parser.add_mutually_exclusive_group(required=required)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--request-id", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="tokens between durable checkpoints (needs --request-id)")
    parser.add_argument(
        "--speculative", choices=("on", "off"), default=None, help="speculate (a draft model, else prompt lookup) or not; default: the server's config"
    )
    parser.add_argument("--adapter", default=None, help="a LoRA adapter the server knows ([[adapters]] or loaded)")
    parser.add_argument("--model", dest="request_model", default=None, help="with several models ([[models]]): the one that serves the request")
    parser.add_argument("--json", action="store_true", help="print each event as one JSON object per line")
    parser.add_argument("--raw", action="store_true", help="send --prompt as it is, not as a chat message rendered by the model's chat template")


async def _stream(config: RuntimeConfig, args) -> Finished | None:
    from runtime.runtime import Runtime

    async with Runtime.open(config) as rt:
        request = user_request(args, chat=rt.model_info.has_chat_template)
        return await print_events(rt.generate(request), args.json)


async def _stream_socket(path: str, args) -> Finished | None:
    """Stream a new request, or resume the checkpointed request `args.resume`."""
    from net.client import Client

    async with Client.connect(path) as client:
        resume = getattr(args, "resume", None)
        events = client.resume(resume) if resume else client.generate(user_request(args, chat=client.welcome.model.has_chat_template))
        return await print_events(events, args.json)


def _finish(finished: Finished | None, as_json: bool) -> int:
    if not as_json:
        print()
    return EXIT_OK if finished and finished.finish_reason != "error" else EXIT_FAILURE


def _generate(args) -> int:
    if args.socket:
        return _finish(anyio.run(_stream_socket, args.socket, args), args.json)
    config = quiet(RuntimeConfig.load(args.config))
    _refuse_unknown_names(config, args)
    return _finish(anyio.run(_stream, config, args), args.json)


def _refuse_unknown_names(config: RuntimeConfig, args) -> None:
    """The sampling flags, `--model` and `--adapter` checked before the model loads (what needs
    no model): in process, the runtime serves the config's model and the adapters it lists, so
    any other name would be refused after seconds of loading."""
    from policies.validation import validate_sampling
    from protocols.api import SamplingParams
    from protocols.errors import AdapterNotFoundError, ModelNotFoundError

    validate_sampling(SamplingParams(temperature=args.temperature, seed=args.seed))

    if args.request_model not in (None, config.model_name):
        raise ModelNotFoundError(f"no model named {args.request_model!r}; {args.config} serves {config.model_name!r}", field="model")
    if args.adapter is not None and args.adapter not in {adapter.name for adapter in config.adapters}:
        raise AdapterNotFoundError(f"no adapter named {args.adapter!r}; {args.config} lists none by that name in [[adapters]]", field="adapter")


def _client(args) -> int:
    path = args.socket or _default_socket()
    if not args.resume and not (args.prompt or args.prompt_ids):
        print("mlxrt client: one of --prompt, --prompt-ids or --resume is required", file=sys.stderr)
        return EXIT_USAGE
    return _finish(anyio.run(_stream_socket, path, args), args.json)


def _chat(args) -> int:
    from tools.chat import ChatOptions

    options = ChatOptions(system=args.system, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, verbose=args.verbose)
    if args.http:
        from runtime import env

        anyio.run(_chat_http, args.http, args.api_key or env.get("SERVER_API_KEY") or "", options)
    elif args.socket:
        anyio.run(_chat_socket, args.socket, options)
    else:
        config = quiet(_with_model(RuntimeConfig.load(args.config), args.model), args.verbose)
        anyio.run(_chat_in_process, config, options)
    return EXIT_OK


async def _chat_in_process(config: RuntimeConfig, options) -> None:
    from runtime.runtime import Runtime
    from tools.chat import chat, event_backend

    async with Runtime.open(config) as rt:
        await chat(event_backend(rt.generate), options, title=config.model_name)


async def _chat_socket(path: str, options) -> None:
    from net.client import Client
    from tools.chat import chat, event_backend

    async with Client.connect(path) as client:
        await chat(event_backend(client.generate), options, title=f"{client.welcome.model.model_type} on {path}")


async def _chat_http(url: str, api_key: str, options) -> None:
    from net.http.client import HttpConnection
    from tools.chat import chat, http_backend

    async with HttpConnection.connect(url, api_key=api_key) as connection:
        model = (await connection.get_json("/v1/models"))["data"][0]["id"]
        await chat(http_backend(connection, model), options, title=f"{model} at {url}")


def _default_socket() -> str:
    from net.socket_path import default_socket_path
    from runtime import env

    return env.get("SERVER_SOCKET") or str(default_socket_path())


def _serve(args) -> int:
    overrides = {k: v for k, v in (("server.socket", args.socket), ("server.http", args.http), ("model.path", args.model)) if v}
    config = RuntimeConfig.load(args.config, overrides=overrides)
    if config.distributed.backend and launched_rank():
        from runtime.follower import run_follower

        try:
            run_follower(config)  # a rank of a world that rank 0 serves
        except RuntimeError as exc:  # the collective raised: a peer is gone
            print(f"mlxrt: rank {launched_rank()}: the world ended: {exc}", file=sys.stderr)
            return EXIT_FAILURE
        return EXIT_OK
    anyio.run(_serve_until_signal, config)
    return EXIT_OK


def _launch(args) -> int:
    if args.ranks < 2 and not args.hostfile:
        raise ConfigError("`mlxrt launch` needs at least 2 ranks (-n)")
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    return launch(RuntimeConfig.load(args.config), args.config, args.ranks, args.hostfile, serve_args)


async def _serve_until_signal(config: RuntimeConfig) -> None:
    from pathlib import Path

    from net.http.server import HttpServer
    from net.socket_path import default_socket_path, prepare
    from runtime.errors import single_errors

    path = Path(config.server.socket) if config.server.socket else default_socket_path()
    # Refuse an unsafe or busy socket path, or a taken HTTP port, before spending time on the model.
    prepare(path, int(config.server.socket_mode, 8))
    http = HttpServer(config) if config.server.http else None
    with single_errors():
        async with anyio.create_task_group() as front:
            if http is not None:
                await front.start(http.serve)  # /health says "loading" until the runtime is attached
            try:
                await _serve_runtime(config, path, http)
            finally:
                if http is not None:
                    http.stop()


async def _serve_runtime(config: RuntimeConfig, path, http) -> None:
    """One runtime (a model pool with `[[models]]`) behind the socket (and HTTP, when on) until
    SIGTERM or SIGINT."""
    from net.server import Server
    from runtime.errors import single_errors
    from runtime.pool import ModelPool
    from runtime.runtime import Runtime

    async with ModelPool.open(config) if config.models else Runtime.open(config) as rt:
        server = Server(rt, config.server, path)
        with single_errors():
            async with anyio.create_task_group() as tg:
                await tg.start(server.serve)
                if http is not None:
                    http.attach(rt)
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    # Announce readiness only once a signal will be handled gracefully.
                    mlxrt, socket = self_command(), shlex.quote(str(path))
                    print(f"mlxrt: serving {config.model_name} ({rt.model_info.model_type}, {rt.model_info.path}) on {path}", flush=True)
                    print(f"mlxrt: try  {mlxrt} client --socket {socket} --prompt {shlex.quote(TRY_PROMPT)}", flush=True)
                    print(f"mlxrt: chat {mlxrt} chat --socket {socket}", flush=True)
                    if http is not None:
                        _print_http(http.url, config)
                    async for signum in signals:
                        print(f"mlxrt: {signal.Signals(signum).name}: finishing", flush=True)
                        break
                # Connections stop reading, HTTP drains and the runtime cancels, together: all are bounded.
                server.stop()
                if http is not None:
                    http.stop()
                await rt.shutdown()


def _print_http(url: str, config: RuntimeConfig) -> None:
    body = json.dumps({"model": config.model_name, "messages": [{"role": "user", "content": TRY_PROMPT}], "max_tokens": 64})
    auth = ' -H "Authorization: Bearer $MLXRT_SERVER_API_KEY"' if config.server.api_key else ""
    print(f"mlxrt: OpenAI-compatible HTTP on {url}/v1 (metrics at {url}/metrics)", flush=True)
    print(f"mlxrt: try  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'", flush=True)


def _demo(args) -> int:
    config = quiet(RuntimeConfig.load(args.config))
    request = GenerateRequest(messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens, report_progress=True)
    print(f"prompt: {args.prompt}\n--- answer ({config.model_name}) ---")
    finished = anyio.run(_demo_stream, config, request)
    if finished is None:
        return EXIT_FAILURE
    t, u = finished.timings, finished.usage
    print(
        f"\n--- {finished.finish_reason}: {u.prompt_tokens} prompt + {u.completion_tokens} generated tokens; "
        f"TTFT {t.ttft_s * 1000:.0f} ms, prefill {t.prefill_tokens_per_s:.0f} tok/s, decode {t.decode_tokens_per_s:.1f} tok/s"
    )
    return EXIT_OK if finished.finish_reason != "error" else EXIT_FAILURE


async def _demo_stream(config: RuntimeConfig, request: GenerateRequest) -> Finished | None:
    from runtime.runtime import Runtime

    async with Runtime.open(config) as rt:
        return await print_events(rt.generate(request), False)


def _bench(args) -> int:
    from tools.bench import BenchOptions, dump, format_table, run_bench

    config = RuntimeConfig.load(args.config)
    if args.real:
        return _bench_real(args, config)
    if args.speculative:
        return _bench_speculative(args, config)
    if args.adapters:
        return _bench_adapters(args, config)
    if args.pool:
        return _bench_pool(args, config)
    if args.kv:
        return _bench_kv(args, config)
    if args.disk:
        return _bench_disk(args, config)
    if args.vision:
        return _bench_vision(args, config)
    if args.denoise:
        return _bench_denoise(args, config)
    if args.distributed:
        return _bench_world(args)
    config = _with_model(config, args.model)
    if args.profile:
        return _bench_profile(args, config)
    workloads = tuple(w for w in args.workloads.split(",") if w)
    unknown = set(workloads) - set(BenchOptions.workloads)
    if unknown:
        print(f"mlxrt bench: unknown workloads {sorted(unknown)}; known: {', '.join(BenchOptions.workloads)}", file=sys.stderr)
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
    print(json.dumps(results["ratios"], indent=2))
    dump(results, args.json_path)
    if args.plot_dir:
        from pathlib import Path

        from tools.plots import plot_bench

        for path in plot_bench(results, Path(args.plot_dir)):
            print(f"wrote {path}")
    return EXIT_OK


def _bench_profile(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.profile import ProfileOptions, format_profile, run_profile

    options = ProfileOptions(concurrency=tuple(int(x) for x in args.concurrency.split(",")), prompt_tokens=args.prompt_tokens, steps=args.profile_steps)
    results = anyio.run(run_profile, config, options)
    print(format_profile(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_real(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.bench_real import MODEL, WORKLOADS, RealBenchOptions, format_real_table, run_real_bench

    workloads = tuple(w for w in args.real_workloads.split(",") if w)
    if set(workloads) - set(WORKLOADS):
        print(f"mlxrt bench --real: unknown workloads {sorted(set(workloads) - set(WORKLOADS))}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
        return EXIT_USAGE
    options = RealBenchOptions(workloads=workloads, repeats=args.repeats, new_tokens=args.new_tokens)
    results = anyio.run(run_real_bench, _with_model(config, args.model or MODEL), options)
    print(format_real_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_speculative(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.bench_spec import WORKLOADS, SpecBenchOptions, format_spec_table, run_spec_bench

    workloads = tuple(w for w in args.spec_workloads.split(",") if w)
    if set(workloads) - set(WORKLOADS):
        print(f"mlxrt bench --speculative: unknown workloads {sorted(set(workloads) - set(WORKLOADS))}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
        return EXIT_USAGE
    # The concurrency workload's levels beyond one stream (`single` is the one-stream workload).
    concurrency = tuple(n for n in (int(x) for x in args.concurrency.split(",")) if n > 1)
    options = SpecBenchOptions(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats, workloads=workloads, concurrency=concurrency)
    results = anyio.run(run_spec_bench, config, options)
    print(format_spec_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _with_model(config: RuntimeConfig, model: str | None) -> RuntimeConfig:
    """`config` serving `model` instead of its own (`--model`), when given."""
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=model)) if model else config


def _bench_adapters(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.bench_adapters import AdapterBenchOptions, format_adapter_table, run_adapter_bench

    config = _with_model(config, args.model)
    options = AdapterBenchOptions(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats)
    results = anyio.run(run_adapter_bench, config, options)
    print(format_adapter_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_pool(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.bench_pool import PoolBenchOptions, format_pool_table, run_pool_bench

    options = PoolBenchOptions(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats)
    results = anyio.run(run_pool_bench, _with_model(config, args.model), options)
    print(format_pool_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_kv(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.bench_kv import FORMATS, WORKLOADS, KvBenchOptions, format_kv_table, run_kv_bench

    workloads = tuple(w for w in args.kv_workloads.split(",") if w)
    if set(workloads) - set(WORKLOADS):
        print(f"mlxrt bench --kv: unknown workloads {sorted(set(workloads) - set(WORKLOADS))}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
        return EXIT_USAGE
    formats = tuple(f for f in args.kv_formats.split(",") if f)
    if set(formats) - set(FORMATS):
        print(f"mlxrt bench --kv: unknown formats {sorted(set(formats) - set(FORMATS))}; known: {', '.join(FORMATS)}", file=sys.stderr)
        return EXIT_USAGE
    options = KvBenchOptions(formats=formats, new_tokens=args.new_tokens, repeats=min(args.repeats, 3), workloads=workloads)
    results = anyio.run(run_kv_bench, _with_model(config, args.model), options)
    print(format_kv_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_disk(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.bench_disk import FORMATS, WORKLOADS, DiskBenchOptions, format_disk_table, run_disk_bench

    workloads = tuple(w for w in args.disk_workloads.split(",") if w)
    formats = tuple(f for f in args.disk_formats.split(",") if f)
    if set(workloads) - set(WORKLOADS) or set(formats) - set(FORMATS):
        print(f"mlxrt bench --disk: workloads are {', '.join(WORKLOADS)}; formats {', '.join(FORMATS)}", file=sys.stderr)
        return EXIT_USAGE
    options = DiskBenchOptions(formats=formats, repeats=min(args.repeats, 3), write_repeats=args.repeats, workloads=workloads)
    results = anyio.run(run_disk_bench, _with_model(config, args.model), options)
    print(format_disk_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_vision(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.bench_vision import DEFAULT_MODEL, WORKLOADS, VisionBenchOptions, format_vision_table, run_vision_bench

    workloads = tuple(w for w in args.vision_workloads.split(",") if w)
    if set(workloads) - set(WORKLOADS):
        print(f"mlxrt bench --vision: workloads are {', '.join(WORKLOADS)}", file=sys.stderr)
        return EXIT_USAGE
    options = VisionBenchOptions(workloads=workloads, repeats=min(args.repeats, 3), new_tokens=args.new_tokens)
    results = anyio.run(run_vision_bench, _with_model(config, args.model or DEFAULT_MODEL), options)
    print(format_vision_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_denoise(args, config: RuntimeConfig) -> int:
    from tools.bench import dump
    from tools.bench_denoise import DEFAULT_MODEL, WORKLOADS, DenoiseBenchOptions, format_denoise_table, run_denoise_bench

    workloads = tuple(w for w in args.denoise_workloads.split(",") if w)
    if set(workloads) - set(WORKLOADS):
        print(f"mlxrt bench --denoise: workloads are {', '.join(WORKLOADS)}", file=sys.stderr)
        return EXIT_USAGE
    options = DenoiseBenchOptions(workloads=workloads, repeats=min(args.repeats, 3), new_tokens=args.new_tokens)
    results = anyio.run(run_denoise_bench, _with_model(config, args.model or DEFAULT_MODEL), options)
    print(format_denoise_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_world(args) -> int:
    from tools.bench import dump
    from tools.bench_world import WorldBenchOptions, format_world_table, run_world_bench

    concurrency = max(int(c) for c in args.concurrency.split(",") if c)
    options = WorldBenchOptions(model=args.model or WorldBenchOptions.model, concurrency=concurrency, new_tokens=args.new_tokens, repeats=min(args.repeats, 3))
    results = anyio.run(run_world_bench, options)
    print(format_world_table(results))
    dump(results, args.json_path)
    return EXIT_OK


def _bench_http(args) -> int:
    from tools.bench_http import HttpBenchOptions, dump_http, format_http_table, run_http_bench

    config = RuntimeConfig.load(args.config)
    config = _with_model(config, args.model)
    options = HttpBenchOptions(requests=args.requests, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    results = anyio.run(run_http_bench, config, options)
    print(format_http_table(results))
    dump_http(results, args.json_path)
    return EXIT_OK


def _bench_hostile(args) -> int:
    from tools.bench_hostile import HOSTILES, HostileBenchOptions, dump_hostile, format_hostile_table, run_hostile_bench

    config = _with_model(RuntimeConfig.load(args.config), args.model)
    hostiles = tuple(args.hostiles.split(",")) if args.hostiles else HOSTILES
    unknown = sorted(set(hostiles) - set(HOSTILES))
    if unknown:
        print(f"mlxrt bench-hostile: unknown hostiles {unknown}; known: {', '.join(HOSTILES)}", file=sys.stderr)
        return EXIT_USAGE
    options = HostileBenchOptions(stream_tokens=args.stream_tokens, rounds=args.rounds, hostiles=hostiles)
    results = anyio.run(run_hostile_bench, config, options)
    print(format_hostile_table(results))
    dump_hostile(results, args.json_path)
    return EXIT_OK


def _config_show(args) -> int:
    config = RuntimeConfig.load(args.config)
    print(msgspec.toml.encode(_drop_none(msgspec.to_builtins(config))).decode(), end="")
    return EXIT_OK


def _drop_none(table: dict) -> dict:
    """TOML has no null: unset optional keys are left out."""
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}


def _config_check(args) -> int:
    RuntimeConfig.load(args.file)
    print(f"{args.file}: ok")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
