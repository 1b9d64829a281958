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
from protocols.redaction import redact_secrets
from runtime.config import RuntimeConfig
from runtime.errors import ConfigError, InvalidRequestError, MlxrtError, ServerBusyError
from tools.cli_bench import add_bench_parsers
from tools.cli_bench_agent import add_bench_agent_parser
from tools.cli_common import EXIT_FAILURE, EXIT_OK, EXIT_REJECTED, EXIT_USAGE, config_arg, with_model
from tools.launch import launch, launched_rank
from tools.terminal import print_events, quiet, self_command, user_request

DEMO_PROMPT = "Explain in three sentences why the sky is blue."
TRY_PROMPT = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if argv is None and args.func is _serve:  # (a server process of its own: jemalloc, runtime.allocator)
        from runtime import allocator

        allocator.reexec_with_jemalloc()
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
    for add in (_add_serve, _add_launch, _add_client, _add_demo, _add_generate, _add_chat, add_bench_parsers, add_bench_agent_parser, _add_config):
        add(sub)
    return parser


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve the configured model on a Unix socket (and over HTTP)")
    config_arg(serve)
    serve.add_argument("--socket", help="socket path (default: [server] socket, or a per-user runtime directory)")
    serve.add_argument("--http", metavar="HOST:PORT", help="also serve the OpenAI-compatible HTTP API here (default: [server] http, off)")
    serve.add_argument("--model", help="override [model] path")
    serve.set_defaults(func=_serve)


def _add_launch(sub) -> None:
    launch = sub.add_parser("launch", help="serve one model sharded over several processes or hosts ([distributed], through mlx.launch)")
    config_arg(launch)
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
    config_arg(demo)
    demo.add_argument("--prompt", default=DEMO_PROMPT)
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.set_defaults(func=_demo)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="one generation, in-process (or through --socket)")
    config_arg(gen)
    gen.add_argument("--socket", default=None, help="use a running server instead of loading the model here")
    _request_args(gen)
    gen.set_defaults(func=_generate)


def _add_chat(sub) -> None:
    chat = sub.add_parser("chat", help="a conversation with the model on this terminal (in-process, or a server's --socket or --http)")
    config_arg(chat)
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


def _add_config(sub) -> None:
    config = sub.add_parser("config", help="show or check configuration")
    config_sub = config.add_subparsers(required=True)
    show = config_sub.add_parser("show", help="the effective config, defaults filled in")
    config_arg(show)
    show.set_defaults(func=_config_show)
    check = config_sub.add_parser("check", help="validate a config file")
    check.add_argument("file")
    check.set_defaults(func=_config_check)


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
        config = quiet(with_model(RuntimeConfig.load(args.config), args.model), args.verbose)
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
        from engine import affinity

        affinity.keep_off_pinned()  # (the loop's work off the kernels' core: engine.affinity)
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


def _config_show(args) -> int:
    config = RuntimeConfig.load(args.config)
    # API keys show as their last characters at most (`protocols.redaction`).
    print(msgspec.toml.encode(_drop_none(redact_secrets(msgspec.to_builtins(config)))).decode(), end="")
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
