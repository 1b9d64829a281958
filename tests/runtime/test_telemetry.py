"""Request spans (OpenTelemetry through an SDK provider, and the JSONL span log) and the
timings the spans are cut from."""

from __future__ import annotations

import json

import msgspec
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from protocols import Finished, GenerateRequest, SamplingParams
from runtime import Runtime
from runtime.config import TracingConfig
from tests.support.config import CHUNK, make_config


async def _finish(rt: Runtime, request: GenerateRequest) -> Finished:
    finished = None
    async for event in rt.generate(request):
        if isinstance(event, Finished):
            finished = event
    assert finished is not None
    return finished


async def test_a_request_is_traced_as_queue_prefill_chunks_and_decode(tmp_path):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    span_log = tmp_path / "spans" / "spans.jsonl"
    config = msgspec.structs.replace(make_config(), tracing=TracingConfig(span_log=str(span_log)))
    prompt = list(range(100, 100 + 3 * CHUNK + 5))
    async with Runtime.open(config, tracer_provider=provider) as rt:
        finished = await _finish(
            rt, GenerateRequest(prompt_ids=prompt, max_tokens=6, ignore_eos=True, request_id="traced", sampling=SamplingParams(temperature=0.0))
        )
    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    (root,) = [s for s in spans if s.name == "mlxrt.request"]
    assert root.attributes["mlxrt.request_id"] == "traced" and root.attributes["mlxrt.completion_tokens"] == 6
    assert names.count("mlxrt.queue") == 1 and names.count("mlxrt.decode") == 1
    # The prompt's last token joins the decode batch unprefilled: 3 full chunks and a partial one.
    assert names.count("mlxrt.prefill_chunk") == 4
    for span in spans:
        if span is not root:
            assert span.parent is not None and span.parent.span_id == root.context.span_id
            assert root.start_time <= span.start_time <= span.end_time <= root.end_time
    lines = [json.loads(line) for line in span_log.read_text().splitlines()]
    assert sorted(line["name"] for line in lines) == sorted(n.removeprefix("mlxrt.") for n in names)
    assert {line["request_id"] for line in lines} == {"traced"} and all(line["duration_s"] >= 0 for line in lines)
    t = finished.timings
    assert t.prefill_s > 0 and t.decode_s > 0 and t.ttft_s >= t.prefill_s


async def test_prefill_speed_counts_only_prefilled_tokens():
    prompt = list(range(200, 200 + 4 * CHUNK))
    request = GenerateRequest(prompt_ids=prompt, max_tokens=3, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    async with Runtime.open(make_config()) as rt:
        await _finish(rt, request)
        warm = await _finish(rt, request)
    cached, t = warm.usage.cached_tokens, warm.timings
    assert cached > 0
    assert t.prefill_tokens_per_s * t.prefill_s == pytest.approx(len(prompt) - cached)
