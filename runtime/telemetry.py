"""Where ended requests go besides their callers: metrics and trace spans.

`Telemetry` is every session's `RequestObserver`. It counts each ended request in
`RuntimeMetrics` and turns its timeline into spans: a "request" span around "queue",
one "prefill_chunk" per chunk, "decode", "fast_forward" (per step that forwarded or
verified a span) and "checkpoint_write". Spans go out as OpenTelemetry spans when an SDK
tracer provider is installed (the API alone records nothing: no SDK, no cost), and as JSON
lines when `tracing.span_log` is set. Lines pass through a bounded buffer to a writer task
that appends them off the event loop; lines that find the buffer full are dropped and counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import msgspec
import structlog
from opentelemetry import trace as otel

from protocols.api import Finished
from protocols.session import RequestTimeline
from runtime.metrics import RuntimeMetrics

log = structlog.get_logger(actor="telemetry")

SPAN_LOG_BUFFER = 1024
TRACER_NAME = "mlxrt"


@dataclass(frozen=True)
class SpanRecord:
    """One span of a request, between monotonic timestamps; `parent` None is the request's own."""

    name: str
    start: float
    end: float
    attributes: dict[str, Any] = field(default_factory=dict)
    parent: str | None = "request"


def request_spans(finished: Finished, timeline: RequestTimeline, end: float) -> list[SpanRecord]:
    """The request span first, then its children in time order."""
    usage, t = finished.usage, timeline
    root = {
        "request_id": finished.request_id,
        "finish_reason": finished.finish_reason,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
    }
    if t.spans_dropped:
        root["spans_dropped"] = t.spans_dropped
    spans = [SpanRecord("request", t.submitted, end, root, parent=None)]
    if t.admitted is not None:
        spans.append(SpanRecord("queue", t.submitted, t.admitted))
    children = [SpanRecord(s.name, s.start, s.end, dict(s.attributes)) for s in t.spans]
    if t.first_token is not None:
        children.append(SpanRecord("decode", t.first_token, t.last_token or t.first_token, {"tokens": usage.completion_tokens}))
    spans += sorted(children, key=lambda s: s.start)
    return spans


class Telemetry:
    """Metrics and spans for every ended request (see the module docstring)."""

    def __init__(self, metrics: RuntimeMetrics, *, span_log: Path | None = None, tracer_provider: Any = None, buffer: int = SPAN_LOG_BUFFER):
        self.metrics = metrics
        self.span_log = span_log
        self.num_dropped_lines = 0
        # Explicit provider (embedding, tests), else whatever is installed globally when a request ends.
        self._provider = tracer_provider
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self._lines_send, self._lines_receive = anyio.create_memory_object_stream[bytes](buffer)
        self._writer_done = anyio.Event()
        if span_log is None:
            self._lines_send.close()
            self._lines_receive.close()
            self._writer_done.set()

    # -- RequestObserver ---------------------------------------------------------------

    def inter_token(self, seconds: float) -> None:
        self.metrics.inter_token(seconds)

    def request_ended(self, finished: Finished, timeline: RequestTimeline) -> None:
        self.metrics.request_ended(finished, timeline)
        provider = self._provider or otel.get_tracer_provider()
        exporting = not isinstance(provider, otel.ProxyTracerProvider | otel.NoOpTracerProvider)
        if not exporting and self.span_log is None:
            return
        spans = request_spans(finished, timeline, time.monotonic())
        if exporting:
            self._export(provider.get_tracer(TRACER_NAME), spans)
        if self.span_log is not None:
            self._enqueue(finished.request_id, spans)

    # -- OpenTelemetry -------------------------------------------------------------------

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns

    def _export(self, tracer, spans: list[SpanRecord]) -> None:
        root_record, *children = spans
        root = tracer.start_span(f"mlxrt.{root_record.name}", start_time=self._ns(root_record.start), attributes=_otel_attributes(root_record.attributes))
        context = otel.set_span_in_context(root)
        for record in children:
            span = tracer.start_span(f"mlxrt.{record.name}", context=context, start_time=self._ns(record.start), attributes=_otel_attributes(record.attributes))
            span.end(end_time=self._ns(record.end))
        root.end(end_time=self._ns(root_record.end))

    # -- JSON lines ----------------------------------------------------------------------

    def _enqueue(self, request_id: str, spans: list[SpanRecord]) -> None:
        lines = b"".join(
            msgspec.json.encode(
                {
                    "request_id": request_id,
                    "name": s.name,
                    "parent": s.parent,
                    "start_unix_s": self._ns(s.start) / 1e9,
                    "duration_s": max(0.0, s.end - s.start),
                    "attributes": s.attributes,
                }
            )
            + b"\n"
            for s in spans
        )
        try:
            self._lines_send.send_nowait(lines)
        except anyio.WouldBlock:
            self.num_dropped_lines += len(spans)
        except anyio.ClosedResourceError:
            pass  # shutting down

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Append queued span lines to `span_log` until `close()`; signals once the file is open."""
        assert self.span_log is not None
        try:
            await anyio.to_thread.run_sync(lambda: self.span_log.parent.mkdir(parents=True, exist_ok=True))  # type: ignore[union-attr]
            async with await anyio.open_file(self.span_log, "ab") as file, self._lines_receive:
                task_status.started()
                async for lines in self._lines_receive:
                    await file.write(lines)
                    await file.flush()
        finally:
            if self.num_dropped_lines:
                log.warning("span_lines_dropped", count=self.num_dropped_lines, span_log=str(self.span_log))
            self._writer_done.set()

    async def close(self) -> None:
        """Take no more spans and wait for the queued lines to be written."""
        self._lines_send.close()
        await self._writer_done.wait()


def _otel_attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    return {f"mlxrt.{key}": value for key, value in attributes.items()}
