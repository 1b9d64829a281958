"""The serving contract: what the socket and HTTP fronts (and an embedding application) use of a
runtime. `Runtime` (one model) and `ModelPool` (several, `[[models]]`) both implement it, and
mypy checks that they do (`runtime.pool`); the fronts are typed against it, never against one of
the two."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self

from protocols.api import AdapterInfo, Event, GenerateRequest
from protocols.config import Pooling
from protocols.model import ModelInfo
from protocols.stats import Stats
from runtime.config import RuntimeConfig
from runtime.metrics import RuntimeMetrics


class EventStream(Protocol):
    """One submitted request's events, `TokenDelta`s (and `PrefillProgress`, `ToolCall`) then one
    `Finished`. Its id is claimed from creation; iterating it once, or closing it, gives it back,
    and leaving before `Finished` cancels the request."""

    request_id: str

    def __aiter__(self) -> AsyncIterator[Event]: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None: ...


class Serving(Protocol):
    @property
    def config(self) -> RuntimeConfig: ...

    @property
    def model_info(self) -> ModelInfo:
        """The default model's (what the socket's `Welcome` and the HTTP model cards describe)."""
        ...

    @property
    def metrics(self) -> RuntimeMetrics:
        """The default model's Prometheus request metrics."""
        ...

    @property
    def world_error(self) -> str | None:
        """Why a distributed world cannot run steps (None: it can, or there is none)."""
        ...

    def submit(self, request: GenerateRequest) -> EventStream:
        """Claim the request's id now (`DuplicateRequestError` for a live one) and return its stream."""
        ...

    def submit_resume(self, request_id: str) -> EventStream:
        """As `submit`, continuing a checkpointed request."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]: ...

    async def prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        """The tokens the request's prompt renders to (chat template, tools), as `submit` renders
        it, without running it (tokenized off the event loop)."""
        ...

    async def embed(
        self, inputs: list[list[int]] | list[str], *, model: str | None = None, pooling: Pooling | None = None, normalize: bool | None = None
    ) -> tuple[list[list[float]], int]:
        """The embedding of each input (texts or token ids) from the named model's final hidden
        states, and the tokens the inputs had in all (`Runtime.embed`)."""
        ...

    async def cancel(self, request_id: str) -> None: ...

    async def stats(self, *, fresh: bool = True) -> Stats:
        """`fresh=False`: as of the actors' last turn, without waiting for a step (`/metrics`)."""
        ...

    def known_models(self) -> list[str]:
        """The names `GenerateRequest.model` may take."""
        ...

    def known_adapters(self) -> list[str]:
        """The adapter names `GenerateRequest.adapter` may take (as of the last load or unload)."""
        ...

    def tokenizer_for(self, model: str | None) -> Any:
        """A model's tokenizer (mlx-lm's `TokenizerWrapper`), for token texts in responses."""
        ...

    async def load_adapter(self, name: str, path: str | Path, *, pinned: bool = False) -> AdapterInfo: ...

    async def unload_adapter(self, name: str) -> None: ...

    async def adapters(self) -> list[AdapterInfo]: ...

    async def shutdown(self) -> None: ...
