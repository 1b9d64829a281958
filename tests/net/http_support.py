"""Helpers for the HTTP tests: a runtime served over HTTP in the test's own event loop, an
`openai` client for it, and raw requests for what no client would send."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import msgspec
from openai import AsyncOpenAI

from net.http.server import HttpServer
from runtime import Runtime, RuntimeConfig
from tests.conftest import make_config

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["zone"]},
    },
}


@dataclass
class Served:
    runtime: Runtime
    http: HttpServer
    url: str
    model: str

    def client(self, api_key: str = "unused") -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60.0)


def http_config(config: RuntimeConfig | None = None, **server) -> RuntimeConfig:
    config = config or make_config()
    return msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, http="127.0.0.1:0", **server))


@asynccontextmanager
async def serving(config: RuntimeConfig | None = None, **server) -> AsyncIterator[Served]:
    """A runtime and its HTTP server on a free loopback port, stopped on exit."""
    config = http_config(config, **server)
    async with Runtime.open(config) as rt:
        http = HttpServer(config)
        async with anyio.create_task_group() as tg:
            url = await tg.start(http.serve)
            http.attach(rt)
            try:
                yield Served(rt, http, url, config.model_name)
            finally:
                http.stop()


async def wait_idle(rt: Runtime, timeout: float = 10.0):
    """The runtime's stats once no request is live (within `timeout`)."""
    with anyio.fail_after(timeout):
        while True:
            stats = await rt.stats()
            if stats.live_requests == 0 and stats.kv.live_requests == 0:
                return stats
            await anyio.sleep(0.02)
