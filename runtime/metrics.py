"""Request metrics of one runtime, in a Prometheus registry of its own (vLLM's names).

`RuntimeMetrics` receives every ended request (`request_ended`, from its session, whether
or not its caller was still reading) and the gaps between a request's token deliveries
(`inter_token`); gauges and cache counters come from the latest `update` with the
scheduler's and KV store's stats. `render()` is Prometheus' text format, `snapshot()` the
same figures as plain data (`Runtime.stats()`, the socket's `Stats`). Synchronous and
cheap: no anyio, no mlx. Names are vLLM's with `mlxrt:` for `vllm:`, each labelled with
`model_name`, so existing dashboards work after a prefix change.
"""

from __future__ import annotations

from collections.abc import Iterator
from threading import Lock

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from protocols.api import Finished
from protocols.kv import DiskStats, KvStats
from protocols.metrics import HistogramSnapshot, MetricsSnapshot
from protocols.scheduler import SchedulerStats
from protocols.session import RequestTimeline

PREFIX = "mlxrt:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets; inter-token latency also gets millisecond buckets (small models on CPUs).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

HISTOGRAMS = {
    # name: (help, buckets or None for token-count buckets)
    "time_to_first_token_seconds": ("Time from submission to the first token.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Time between successive token deliveries of a request.", ITL_BUCKETS),
    "e2e_request_latency_seconds": ("Time from submission to the end of a request.", REQUEST_TIME_BUCKETS),
    "request_queue_time_seconds": ("Time a request waited for admission.", REQUEST_TIME_BUCKETS),
    "request_prefill_time_seconds": ("Time from a request's first prefill chunk to its first token.", REQUEST_TIME_BUCKETS),
    "request_decode_time_seconds": ("Time from a request's first token to its last.", REQUEST_TIME_BUCKETS),
    "request_prompt_tokens": ("Prompt tokens per finished request.", None),
    "request_generation_tokens": ("Generated tokens per finished request.", None),
}


def token_buckets(max_context: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to the context (vLLM's `build_1_2_5_buckets`)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_context:
                return buckets
            buckets.append(float(m * scale))
        scale *= 10


class RuntimeMetrics:
    """Counters and histograms of finished requests, gauges of the latest stats."""

    def __init__(self, model_name: str, max_context: int):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, [model_name]
        self._prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished requests.", ["model_name"], registry=r)
        self._generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens of finished requests.", ["model_name"], registry=r)
        self._finished = Counter(f"{PREFIX}request_success", "Finished requests by reason.", ["model_name", "finished_reason"], registry=r)
        self._ff_events = Counter(f"{PREFIX}fast_forward_events", "Fast-forwarded spans that put tokens into outputs.", ["model_name"], registry=r)
        self._ff_tokens = Counter(f"{PREFIX}fast_forward_tokens", "Tokens fast-forwarded into outputs, by kind.", ["model_name", "kind"], registry=r)
        self._ff_verified = Counter(
            f"{PREFIX}fast_forward_verified_tokens", "Echo tokens the model's own greedy choice accepted or rejected.", ["model_name", "outcome"], registry=r
        )
        # vLLM's speculative decoding counters: rounds, drafted tokens, kept ones (also by position).
        self._spec = {
            name: Counter(f"{PREFIX}spec_decode_{name}", text, ["model_name"], registry=r)
            for name, text in (
                ("num_drafts", "Speculative rounds (a draft checked by one target forward)."),
                ("num_draft_tokens", "Drafted tokens."),
                ("num_accepted_tokens", "Drafted tokens kept."),
            )
        }
        self._spec_by_position = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos", "Rounds that kept the draft token at each position.", ["model_name", "position"], registry=r
        )
        for totals in (self._prompt_tokens, self._generation_tokens, self._ff_events):
            totals.labels(*label)  # reported (as 0) from the start
        self._histograms = {
            name: Histogram(f"{PREFIX}{name}", text, ["model_name"], buckets=buckets or token_buckets(max_context), registry=r).labels(*label)
            for name, (text, buckets) in HISTOGRAMS.items()
        }
        self._lock = Lock()
        self._stats: tuple[SchedulerStats, KvStats] | None = None
        self.registry.register(_StatsCollector(self))

    # -- observations --------------------------------------------------------------

    def inter_token(self, seconds: float) -> None:
        self._histograms["inter_token_latency_seconds"].observe(seconds)

    def request_ended(self, finished: Finished, timeline: RequestTimeline) -> None:
        """Count a request that ended (any reason), and observe its latencies and lengths."""
        usage, t, h = finished.usage, finished.timings, self._histograms
        self._prompt_tokens.labels(self.model_name).inc(usage.prompt_tokens)
        self._generation_tokens.labels(self.model_name).inc(usage.completion_tokens)
        self._finished.labels(self.model_name, finished.finish_reason).inc()
        h["e2e_request_latency_seconds"].observe(t.total_s)
        h["request_prompt_tokens"].observe(usage.prompt_tokens)
        h["request_generation_tokens"].observe(usage.completion_tokens)
        if timeline.admitted is not None:
            h["request_queue_time_seconds"].observe(t.queue_s)
        if timeline.first_token is not None:
            h["time_to_first_token_seconds"].observe(t.ttft_s)
            h["request_prefill_time_seconds"].observe(t.prefill_s)
            h["request_decode_time_seconds"].observe(t.decode_s)
        fill = finished.fill
        if fill is not None:
            self._ff_events.labels(self.model_name).inc(fill.events)
            for kind, count in (("strict", fill.strict), ("echo", fill.echo)):
                self._ff_tokens.labels(self.model_name, kind).inc(count)
            for outcome, count in (("accepted", fill.verify_accepted), ("rejected", fill.verify_rejected)):
                self._ff_verified.labels(self.model_name, outcome).inc(count)
        spec = finished.spec
        if spec is not None and spec.refused is None:
            for name, count in (("num_drafts", spec.rounds), ("num_draft_tokens", spec.drafted), ("num_accepted_tokens", spec.accepted)):
                self._spec[name].labels(self.model_name).inc(count)
            for position, count in enumerate(spec.accepted_by_position):
                self._spec_by_position.labels(self.model_name, str(position)).inc(count)

    def update(self, scheduler: SchedulerStats, kv: KvStats) -> None:
        """The gauges (and the KV store's cache counters) `render` reports next."""
        with self._lock:
            self._stats = (scheduler, kv)

    def latest_stats(self) -> tuple[SchedulerStats, KvStats] | None:
        with self._lock:
            return self._stats

    # -- output --------------------------------------------------------------------

    def render(self) -> bytes:
        """Prometheus' text exposition format (`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def snapshot(self) -> MetricsSnapshot:
        return MetricsSnapshot(
            model_name=self.model_name,
            prompt_tokens=_by_label(self._prompt_tokens, "model_name").get(self.model_name, 0),
            generation_tokens=_by_label(self._generation_tokens, "model_name").get(self.model_name, 0),
            finished=_by_label(self._finished, "finished_reason"),
            fast_forward_events=_by_label(self._ff_events, "model_name").get(self.model_name, 0),
            fast_forward_tokens=_by_label(self._ff_tokens, "kind"),
            fast_forward_verified_tokens=_by_label(self._ff_verified, "outcome"),
            histograms={name: _histogram(metric) for name, metric in self._histograms.items()},
        )


class _StatsCollector:
    """Gauges and cache counters read from the latest stats (nothing before the first update)."""

    def __init__(self, metrics: RuntimeMetrics):
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # collected at each scrape; nothing to check for name clashes up front

    def collect(self) -> Iterator[Metric]:
        stats = self._metrics.latest_stats()
        if stats is None:
            return
        scheduler, kv = stats
        name = self._metrics.model_name

        def gauge(metric: str, text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + metric, text, labels=["model_name"])
            family.add_metric([name], value)
            return family

        def counter(metric: str, text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + metric, text, labels=["model_name"])
            family.add_metric([name], value)
            return family

        yield gauge("num_requests_running", "Requests prefilling or decoding.", scheduler.prefilling + scheduler.decoding)
        yield gauge("num_requests_waiting", "Requests waiting for admission.", scheduler.waiting)
        yield gauge("num_requests_paused", "Admitted requests whose callers are not reading (KV kept, no batch slot).", scheduler.paused)
        yield gauge("num_requests_held", "Bulk requests out of the batch (KV kept) while interactive ones are live.", scheduler.held)
        if kv.budget_bytes:
            usage = (kv.reserved_bytes + kv.prefix_bytes) / kv.budget_bytes
            yield gauge("kv_cache_usage_perc", "Fraction of kv.budget_bytes reserved by requests and prefix entries.", usage)
            yield gauge("kv_cache_budget_bytes", "The KV budget (kv.budget_bytes).", kv.budget_bytes)
        by_kind = GaugeMetricFamily(
            PREFIX + "kv_cache_bytes", "KV bytes: reserved by requests, live, prefix entries, physical (float and quantized).", labels=["model_name", "kind"]
        )
        held = (("physical_float", kv.physical_bytes - kv.quantized_bytes), ("physical_quantized", kv.quantized_bytes))
        for kind, value in (("reserved", kv.reserved_bytes), ("live", kv.live_bytes), ("prefix", kv.prefix_bytes), ("physical", kv.physical_bytes), *held):
            by_kind.add_metric([name, kind], value)
        yield by_kind
        if kv.pool is not None:
            blocks = GaugeMetricFamily(
                PREFIX + "kv_cache_blocks", "Paged KV pool blocks (kv.block_size): held, free, shared by several holders.", labels=["model_name", "state"]
            )
            for state, value in (("held", kv.pool.used), ("free", kv.pool.free), ("shared", kv.pool.shared)):
                blocks.add_metric([name, state], value)
            yield blocks
            allocated = kv.pool.used * kv.pool.block_size
            fragmentation = kv.pool.unused_positions / allocated if allocated else 0.0
            yield gauge("kv_cache_fragmentation", "Of the positions in held pool blocks, the share past their holders' ends.", fragmentation)
        yield gauge("lora_adapter_bytes", "Bytes of the resident LoRA adapters' stacks.", kv.adapter_bytes)
        device = GaugeMetricFamily(
            PREFIX + "device_memory_bytes", "MLX memory: active (in use), peak, cache (freed, kept for reuse).", labels=["model_name", "kind"]
        )
        for kind, value in (("active", kv.device_active_bytes), ("peak", kv.device_peak_bytes), ("cache", kv.device_cache_bytes)):
            device.add_metric([name, kind], value)
        yield device
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.prefix_tokens_queried)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_tokens_reused)
        yield counter("checkpoints_written", "Durable checkpoints written.", kv.checkpoints_written)
        yield counter("checkpoints_failed", "Durable checkpoint writes that failed.", kv.checkpoints_failed)
        if kv.disk is not None:
            yield from _disk_metrics(kv.disk, gauge, counter)


def _disk_metrics(disk: DiskStats, gauge, counter) -> Iterator[Metric]:
    """The prefix cache's disk tier (`kv.disk_cache_dir`)."""
    yield gauge("kv_disk_entries", "Entry files in the prefix cache's disk tier.", disk.entries)
    yield gauge("kv_disk_bytes", "Bytes of the disk tier's files (at most kv.disk_cache_bytes).", disk.bytes)
    yield gauge("kv_disk_writable", "Whether the disk tier writes entries (0: read-only, or paused after a failure).", float(disk.writable))
    yield counter("kv_disk_hits", "Requests seeded from the disk tier.", disk.hits)
    yield counter("kv_disk_misses", "Prefix lookups the disk tier could not improve on.", disk.misses)
    yield counter("kv_disk_tokens_loaded", "Prompt tokens read from the disk tier instead of prefilled.", disk.tokens_loaded)
    yield counter("kv_disk_load_seconds", "Seconds spent reading and checking disk tier files.", disk.load_s)
    yield counter("kv_disk_writes", "Disk tier files written.", disk.writes)
    yield counter("kv_disk_export_seconds", "Seconds the MLX thread spent copying prefix entries out for the disk tier.", disk.export_s)
    yield counter("kv_disk_write_seconds", "Seconds spent hashing and writing disk tier files (worker threads).", disk.write_s)
    yield counter("kv_disk_write_failures", "Disk tier writes that failed (writes pause after one).", disk.write_failures)
    yield counter("kv_disk_writes_skipped", "Entries not written: too much in flight, or writes paused.", disk.writes_skipped)
    yield counter("kv_disk_evicted", "Disk tier files evicted (least recently used first).", disk.evicted)
    yield counter("kv_disk_removed_damaged", "Disk tier files found damaged or foreign, and removed.", disk.removed_damaged)


def _by_label(counter: Counter, label: str) -> dict[str, int]:
    found = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                found[sample.labels[label]] = int(sample.value)
    return found


def _histogram(histogram) -> HistogramSnapshot:
    bounds, counts, count, total = [], [], 0, 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels["le"] != "+Inf":
                bounds.append(float(sample.labels["le"]))
                counts.append(int(sample.value))
            elif sample.name.endswith("_count"):
                count = int(sample.value)
            elif sample.name.endswith("_sum"):
                total = sample.value
    return HistogramSnapshot(bounds=bounds, counts=counts, count=count, sum=total)
