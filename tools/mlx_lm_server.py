"""mlx-lm's own HTTP server (`python -m mlx_lm.server`) as a subprocess, on the weights mlxrt serves.

`mlx_lm_model_dir(path)` is an mlx-lm model directory for a config's model: a directory as it
is, a `builtin:` model's built directory, or, for a GGUF file (which mlx-lm cannot read), the
weights our loader reads exported once with mlx-lm's own save utilities (float32 on the CPU
backend, as the runtime serves them) under `$MLXRT_HOME/mlx-lm-exports/`.
`MlxLmServer.start(model_dir)` runs the server on a free loopback port until the context exits.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

# Built on first use; a changed export format gets a new directory.
EXPORT_VERSION = 1


def mlx_lm_model_dir(path: str, *, root: Path) -> Path:
    """An mlx-lm model directory holding the weights of model `path` (blocking; may run the
    MLX work of a GGUF export on the calling thread, so call it on an MLX thread)."""
    from engine.builtin import builtin_name, ensure_builtin
    from engine.model.gguf import is_gguf

    name = builtin_name(path)
    resolved = ensure_builtin(name, root=root) if name else Path(path)
    if not is_gguf(resolved):
        return resolved
    from engine.model.gguf.format import GGUFFile

    with GGUFFile.open(resolved) as file:
        digest = file.digest()[:16]
    target = root / "mlx-lm-exports" / f"{resolved.stem}-{digest}-v{EXPORT_VERSION}"
    if not (target / "config.json").is_file():
        _export_gguf(resolved, target, root)
    return target


def _export_gguf(path: Path, target: Path, root: Path) -> None:
    """Our loader's model for the GGUF file `path`, saved as an mlx-lm directory (atomically)."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from engine.model.gguf.model import load_gguf
    from engine.model.weights import apply_cpu_policy, keeps_quantized

    loaded = load_gguf(path, cache_root=root, keeps_quantized=lambda need: keeps_quantized("auto", need))
    model = loaded.model
    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        apply_cpu_policy(model, "auto")
    config = dict(loaded.config)
    quantized = [m for _, m in model.named_modules() if hasattr(m, "scales")]
    if quantized:  # mlx-lm infers each layer's bits from its tensors; it needs a default
        config["quantization"] = {"group_size": quantized[0].group_size, "bits": quantized[0].bits}
    config["eos_token_id"] = sorted(loaded.tokenizer.eos_token_ids)
    staging = target.with_name(f"{target.name}.staging-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    save_model(staging, model)
    save_config(config, staging / "config.json")
    loaded.tokenizer.save_pretrained(str(staging))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


class MlxLmServerError(RuntimeError):
    """mlx_lm.server exited, or did not answer, before it was ready."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MlxLmServer:
    """A running `mlx_lm.server` subprocess; `url` is its base URL."""

    def __init__(self, process: subprocess.Popen, url: str):
        self.process = process
        self.url = url

    @classmethod
    @contextmanager
    def start(cls, model_dir: Path, *, ready_timeout_s: float = 300.0, extra_args: tuple[str, ...] = ()) -> Iterator[MlxLmServer]:
        """mlx-lm's server on `model_dir`, stopped (SIGTERM, then SIGKILL) when the context exits."""
        from runtime import blas

        port = free_port()
        env = dict(os.environ)
        status = blas.status()
        # The same fast BLAS, and its threads' spin setting, that this process runs with.
        if status.state == "loaded" and status.library:
            env["LD_PRELOAD"] = status.library
            env["OPENBLAS_THREAD_TIMEOUT"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT", blas.THREAD_TIMEOUT)
        command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port), "--log-level", "WARNING", *extra_args]
        # A file, not a pipe: nobody reads it while the server runs, and a full pipe would block it.
        with tempfile.TemporaryFile() as stderr:
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            try:
                url = f"http://127.0.0.1:{port}"
                _wait_ready(process, stderr, url, ready_timeout_s)
                yield cls(process, url)
            finally:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def _wait_ready(process: subprocess.Popen, stderr: IO[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            stderr.seek(0)
            raise MlxLmServerError(f"mlx_lm.server exited with status {process.returncode}: {stderr.read().decode(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2.0) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise MlxLmServerError(f"mlx_lm.server did not answer on {url} within {timeout_s:.0f}s")
