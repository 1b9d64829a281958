"""Memory figures: what MLX holds, beside the KV ledger's own accounting."""

from __future__ import annotations

from protocols import GenerateRequest
from runtime import Runtime
from tests.support.config import make_config


async def test_stats_and_metrics_report_the_devices_memory():
    async with Runtime.open(make_config()) as rt:
        async for _ in rt.generate(GenerateRequest(prompt_ids=list(range(3, 40)), max_tokens=8)):
            pass
        kv = (await rt.stats()).kv
        text = rt.metrics.render().decode()
    assert kv.device_active_bytes > 0, "weights and KV are on the device"
    assert kv.device_peak_bytes >= kv.device_active_bytes
    assert kv.device_cache_bytes >= 0
    assert 'mlxrt:device_memory_bytes{kind="active",model_name="builtin:tiny"}' in text
