"""`mlxrt launch`: start a distributed world of `mlxrt serve` ranks.

`mlxrt launch -n 2 --config c.toml [-- serve flags]` on one machine with the ring backend
starts the ranks itself (`LocalWorld`): a ring hostfile on free local ports, `MLX_RANK` and
`MLX_HOSTFILE` per rank, the ranks' output on this terminal. (mlx.launch does the same but
polls its ranks' pipes without sleeping, which costs a core per rank on a small machine.)
With hosts (`--hostfile`, or `distributed.hostfile`) or another backend it runs mlx.launch:
`mlx.launch --backend <backend> --hostfile <hosts> -- <python> -m tools.cli serve ...`.
Either way rank 0 serves the socket (and HTTP), every other rank follows it, and the world
ends when any rank fails. Every rank gets the world's control secret (`MLXRT_DISTRIBUTED_SECRET`:
the caller's, else a fresh random one per launch), which rank 0's control connections check.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from protocols.config import WORLD_SECRET_VARIABLE
from runtime import env
from runtime.config import RuntimeConfig
from runtime.errors import ConfigError

# mlx.launch, run by this interpreter (the module has no `__main__`).
_MLX_LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
# The variables launchers set for a rank's index (ours and mlx.launch: MLX_RANK; MPI's).
RANK_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# After rank 0 exits (or a signal), the others get this long to follow before SIGKILL.
GRACE_S = 10.0
# A rank failed: rank 0 gets this long to tell its clients before it is asked to shut down.
NOTICE_S = 3.0


def launched_rank() -> int | None:
    """This process's rank, as its launcher says (None: not launched as a world)."""
    for name in RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None


def serve_command(config_path: str, serve_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "tools.cli", "serve", "--config", str(Path(config_path).resolve()), *serve_args]


def mlx_launch_command(config: RuntimeConfig, config_path: str, ranks: int, hostfile: str | None, serve_args: list[str]) -> list[str]:
    backend = config.distributed.backend
    hosts = hostfile or config.distributed.hostfile
    where = ["--hostfile", hosts] if hosts else ["--hosts", "127.0.0.1", "-n", str(ranks)]
    # ("any": mlx.launch's own choice, NCCL with CUDA, else ring.)
    launcher = [sys.executable, "-c", _MLX_LAUNCH, *(["--backend", backend] if backend != "any" else []), *where]
    return [*launcher, "--cwd", os.getcwd(), "--", *serve_command(config_path, serve_args)]


def launch(config: RuntimeConfig, config_path: str, ranks: int, hostfile: str | None, serve_args: list[str]) -> int:
    """Run the world until it ends; 0 if every rank exited cleanly."""
    backend = config.distributed.backend
    if not backend:
        raise ConfigError(f"{config_path}: `mlxrt launch` needs `[distributed] backend` (ring on one machine or over TCP, mpi, jaccl, nccl)")
    environ = launch_environ()
    if backend == "ring" and not (hostfile or config.distributed.hostfile):
        return LocalWorld(ranks, serve_command(config_path, serve_args), environ).run()
    command = mlx_launch_command(config, config_path, ranks, hostfile, serve_args)
    print("mlxrt: launching " + " ".join(command), flush=True)
    # mlx.launch forwards its stdin to every rank: an empty pipe kept open (not a terminal's input).
    with subprocess.Popen(command, stdin=subprocess.PIPE, env=environ) as world:
        try:
            return world.wait()
        except KeyboardInterrupt:
            world.terminate()
            return world.wait()


def launch_environ() -> dict[str, str]:
    """The ranks' environment: this one, with MLXRT_HOME, and the world's control secret: the
    caller's (set the same on every host of a hostfile), else a fresh one for this launch."""
    environ = {**os.environ, env.PREFIX + "HOME": str(env.home())}
    if not env.world_secret():
        # (Local ranks inherit it; mlx.launch's `--env` would show it in every process list.)
        environ[WORLD_SECRET_VARIABLE] = secrets.token_hex(32)
    return environ


def free_ports(n: int) -> list[int]:
    """n ports free on 127.0.0.1 now (held open together, so they differ)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


class LocalWorld:
    """`ranks` processes of one command on this machine, joined by a ring over loopback."""

    def __init__(self, ranks: int, command: list[str], environ: dict[str, str]):
        self.ranks = ranks
        self.command = command
        self.environ = environ
        self.processes: list[subprocess.Popen] = []

    def run(self) -> int:
        *ring, control = free_ports(self.ranks + 1)
        hosts = [[f"127.0.0.1:{port}"] for port in ring]
        with tempfile.NamedTemporaryFile("w", prefix="mlxrt-ring-", suffix=".json", delete=False) as hostfile:
            json.dump(hosts, hostfile)
        print(f"mlxrt: launching {self.ranks} ranks on 127.0.0.1 (ring {hostfile.name}): {' '.join(self.command)}", flush=True)
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for rank in range(self.ranks):
                rank_env = {
                    # The ranks share this machine's cores: BLAS threads split between them
                    # (more would make each rank's matmuls fight the other's).
                    "OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // self.ranks)),
                    **self.environ,
                    "MLX_RANK": str(rank),
                    "MLX_HOSTFILE": hostfile.name,
                    "MLX_WORLD_SIZE": str(self.ranks),
                }
                # (Set, even empty, it is the caller's: "" sends plans through collectives.)
                rank_env.setdefault(env.PREFIX + "DISTRIBUTED_CONTROL", f"127.0.0.1:{control}")
                self.processes.append(subprocess.Popen(self.command, env=rank_env, stdin=subprocess.DEVNULL))
            return self._supervise()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._end_all(0)
            Path(hostfile.name).unlink(missing_ok=True)

    def _forward(self, signum, frame) -> None:
        """A signal to the launcher asks rank 0 for a clean shutdown (which stops the rest)."""
        if self.processes and self.processes[0].poll() is None:
            self.processes[0].send_signal(signal.SIGTERM)

    def _supervise(self) -> int:
        while True:
            codes = [p.poll() for p in self.processes]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                for rank, code in failed:
                    print(f"mlxrt: rank {rank} exited with {code}: ending the world", file=sys.stderr, flush=True)
                # Rank 0 first ends the requests the lost rank was running (typed, `unavailable`).
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.processes[0].wait(NOTICE_S)
                self._end_all(GRACE_S)
                return 1
            if codes[0] == 0:  # rank 0 shut down cleanly and told the others to stop
                self._end_all(GRACE_S)
                return max(p.returncode or 0 for p in self.processes)
            time.sleep(0.1)

    def _end_all(self, grace_s: float) -> None:
        """SIGTERM to rank 0 (a clean shutdown), then wait up to `grace_s`, then SIGKILL."""
        live = [p for p in self.processes if p.poll() is None]
        if live and self.processes[0].poll() is None:
            self.processes[0].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
