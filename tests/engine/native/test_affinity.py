"""`engine.affinity`: the stream thread that runs an MLX thread's kernels gets a core of its own,
the MLX thread and the quantized products' helper keep off it, claims never overlap (in one
process or across processes, by lock file), and `release` puts every mask back.

Each case runs on a thread of its own, as the MLX thread does: MLX's default stream (and so its
stream thread) is the thread's own, and `pin` changes the calling thread's mask."""

from __future__ import annotations

import fcntl
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import pytest

from engine import affinity

T = TypeVar("T")

pytestmark = pytest.mark.skipif(sys.platform != "linux" or len(os.sched_getaffinity(0)) < 2, reason="thread affinity: Linux with two cores or more")


def _on_a_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a new thread (its own MLX default stream); its result, or its exception raised."""
    box: list = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # re-raised on the test's thread
            box.extend([None, exc])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if len(box) == 2:
        raise box[1]
    return box[0]


def _stream_tid(kernels) -> int:
    return int(kernels.stream_thread_id().item())


def _hold(lock_dir: Path, core: int) -> int:
    """Claim `core` as another process would (its own open file: flock treats it apart)."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_dir / f"core-{core}", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_pin_gives_the_kernels_thread_a_core_and_release_gives_it_back(kernels, tmp_path):
    allowed = os.sched_getaffinity(0)

    def run():
        # (A product big enough that the helper takes a share of its features.)
        w = mx.random.normal((256, 512), key=mx.random.key(1))
        x = mx.random.normal((1, 512), key=mx.random.key(2))
        q, s, b = mx.quantize(w, group_size=64, bits=4)
        before = kernels.quantized_matmul(x, q, s, b, group_size=64, bits=4)
        mx.eval(before)
        core = affinity.pin(tmp_path)
        stream, helper = _stream_tid(kernels), kernels.helper_thread_id()
        pinned = (core, os.sched_getaffinity(stream), os.sched_getaffinity(0), os.sched_getaffinity(helper), affinity.pin(tmp_path), affinity.pinned())
        # The kernels still run, from their core: the same bits.
        same = bool(mx.array_equal(kernels.quantized_matmul(x, q, s, b, group_size=64, bits=4), before).item())
        affinity.release()
        released = (os.sched_getaffinity(stream), os.sched_getaffinity(0), os.sched_getaffinity(helper), affinity.pinned())
        return pinned, same, released

    (core, stream_mask, own_mask, helper_mask, again, pinned_now), same, released = _on_a_thread(run)
    assert core == max(allowed), "the last core of the mask is taken first"
    assert stream_mask == {core}
    assert core not in own_mask and own_mask and own_mask <= allowed
    assert core not in helper_mask and helper_mask
    assert again == core and pinned_now == core, "pinning twice keeps the first core"
    assert same
    assert released == (allowed, allowed, allowed, None)


def test_a_core_claimed_by_another_process_is_passed_over(kernels, tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    held = _hold(tmp_path, allowed[-1])
    try:

        def run():
            core = affinity.pin(tmp_path)
            affinity.release()
            return core

        core = _on_a_thread(run)
    finally:
        os.close(held)
    # The next core where another stays free for the rest; with two cores, none.
    assert core == (allowed[-2] if len(allowed) >= 3 else None)


def test_nothing_is_pinned_unless_another_core_stays_free(kernels, tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    held = [_hold(tmp_path, core) for core in allowed[:-1]]
    try:

        def run():
            mask = os.sched_getaffinity(0)
            return affinity.pin(tmp_path), os.sched_getaffinity(_stream_tid(kernels)), mask, os.sched_getaffinity(0)

        core, stream_mask, before, after = _on_a_thread(run)
    finally:
        for fd in held:
            os.close(fd)
    assert core is None
    assert stream_mask == set(allowed) and after == before, "no mask changed"


def test_two_mlx_threads_of_one_process_never_share_a_core(kernels, tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    first_pinned, second_done, first_done = threading.Event(), threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def first():
        results["first"] = affinity.pin(tmp_path)
        first_pinned.set()
        second_done.wait(30)
        affinity.release()
        first_done.set()

    def second():
        first_pinned.wait(30)
        results["second"] = affinity.pin(tmp_path)
        results["second_stream"] = os.sched_getaffinity(_stream_tid(kernels))
        affinity.release()
        second_done.set()
        first_done.wait(30)
        results["after"] = affinity.pin(tmp_path)  # the first thread's core is free again
        affinity.release()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["first"] == allowed[-1]
    if len(allowed) >= 3:
        assert results["second"] == allowed[-2] and results["second_stream"] == {allowed[-2]}
    else:
        assert results["second"] is None and results["second_stream"] == set(allowed)
    assert results["after"] == allowed[-1]


def test_a_thread_kept_off_the_pinned_core_only_while_one_is_pinned(kernels, tmp_path):
    """`mlxrt serve`'s event loop (here another thread of the process) keeps off the core the MLX
    thread pinned; with nothing pinned it is left as it is."""
    allowed = os.sched_getaffinity(0)
    assert _on_a_thread(affinity.keep_off_pinned) is None  # (nothing pinned: unchanged)
    pinned = threading.Event()
    done = threading.Event()
    found: list = []

    def mlx_thread() -> None:
        found.append(affinity.pin(tmp_path))
        pinned.set()
        done.wait(timeout=60)
        affinity.release()

    thread = threading.Thread(target=mlx_thread)
    thread.start()
    try:
        assert pinned.wait(timeout=60)
        core = found[0]
        kept = _on_a_thread(lambda: (affinity.keep_off_pinned(), os.sched_getaffinity(0)))
    finally:
        done.set()
        thread.join()
    assert core is not None
    assert kept[0] == kept[1] == allowed - {core}
