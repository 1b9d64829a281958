"""Live requests: each id claimed from submission to its end, and each request's event stream.

`Requests` is the runtime's one registry of request ids, and so its only duplicate check:
`claim` is synchronous, so a cancel that arrives while a request is still being prepared
just marks its claim, and applies the moment the request starts. `start` hands a prepared
request to the scheduler and runs its session actor; `RequestStream` yields the session's
events and cancels the request if its caller leaves before `Finished`; `PoolStream` is the
same for a `ModelPool`'s request (which may live through several runtimes).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from actors.mailbox import EventChannel, Mailbox
from actors.session import SessionActor
from policies import features
from protocols.api import Event, Finished
from protocols.errors import DuplicateRequestError, RuntimeClosedError, ServerBusyError, error_for
from protocols.scheduler import AddRequest, CancelRequest
from protocols.session import RequestRejected
from runtime.admission import Prepared

log = structlog.get_logger(actor="runtime")

# Builds a request's session actor around the channel its events go to.
MakeSession = Callable[[Prepared, EventChannel], SessionActor]


@dataclass(eq=False)
class Claim:
    """A request's hold on its id, from submission until its session ends."""

    request_id: str
    session: SessionActor | None = None
    cancelled: bool = False


class Requests:
    """The live requests of one runtime, by id."""

    def __init__(self, *, scheduler: Mailbox, task_group, make_session: MakeSession, release: Callable[[Prepared], None], buffer: int):
        self._scheduler = scheduler
        self._task_group = task_group
        self._make_session = make_session
        self._release = release
        self._buffer = buffer
        self._claims: dict[str, Claim] = {}
        self._empty = anyio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._claims)

    def claim(self, request_id: str) -> Claim:
        """Hold `request_id` for a new request; raises `DuplicateRequestError` while it is live."""
        if request_id in self._claims:
            raise DuplicateRequestError(f"request_id {request_id!r} is already in use")
        claim = self._claims[request_id] = Claim(request_id)
        self._empty = anyio.Event()
        return claim

    def unclaim(self, claim: Claim) -> None:
        """Give the id back (the request never started, or its session has ended)."""
        if self._claims.get(claim.request_id) is claim:
            del self._claims[claim.request_id]
        if not self._claims:
            self._empty.set()

    def start(self, claim: Claim, prepared: Prepared) -> EventChannel:
        """Hand a prepared request to the scheduler and start its session; returns its events."""
        events = EventChannel[Event | RequestRejected](self._buffer)
        session = self._make_session(prepared, events)
        request = prepared.request
        message = AddRequest(
            admit=prepared.admit,
            submitted=time.monotonic(),
            session=session.inbox,
            request=request,
            priority=request.priority,
            report_progress=request.report_progress,
            bulk=features.is_bulk(request),
            checkpoint_every=prepared.checkpoint_every,
        )
        try:
            self._scheduler.send_nowait(message)
            if claim.cancelled:
                self._scheduler.send_nowait(CancelRequest(request_id=claim.request_id))
        except anyio.WouldBlock:
            self._release(prepared)
            raise ServerBusyError("the scheduler's inbox is full") from None
        claim.session = session
        self._task_group.start_soon(self._run_session, claim, prepared, name=f"session-{claim.request_id}")
        return events

    async def _run_session(self, claim: Claim, prepared: Prepared) -> None:
        assert claim.session is not None
        with structlog.contextvars.bound_contextvars(request_id=claim.request_id):
            try:
                await claim.session.run()
            finally:
                self.unclaim(claim)
                self._release(prepared)

    async def cancel(self, request_id: str, *, keep_checkpoint: bool = False) -> None:
        """End a request at the next step boundary (at its start, if it is being prepared)."""
        claim = self._claims.get(request_id)
        if claim is None:
            return
        claim.cancelled = True
        if claim.session is not None:
            await self._scheduler.send(CancelRequest(request_id=request_id, keep_checkpoint=keep_checkpoint))

    async def cancel_claim(self, claim: Claim) -> None:
        """Cancel this very request (its id may already belong to a newer one)."""
        if self._claims.get(claim.request_id) is claim:
            await self.cancel(claim.request_id)

    async def wind_down(self, grace_s: float) -> None:
        """Cancel every live request (keeping checkpoints), give callers `grace_s` to read their
        `Finished`, then end the streams of those that did not."""
        for request_id in list(self._claims):
            await self.cancel(request_id, keep_checkpoint=True)
        with anyio.move_on_after(grace_s):
            await self._empty.wait()
        for claim in list(self._claims.values()):
            if claim.session is not None:
                claim.session.abandon()
        with anyio.move_on_after(grace_s):
            await self._empty.wait()


class RequestStream:
    """The events of one submitted request: `TokenDelta`s (and `PrefillProgress` if asked),
    then exactly one `Finished`.

    Its id is claimed from creation. Iterate it once, or close it (`aclose`, `async with`),
    to give the id back; leaving the iteration early cancels the request.
    """

    def __init__(self, requests: Requests, claim: Claim, prepare: Callable[[], Awaitable[Prepared]]):
        self.request_id = claim.request_id
        self._requests = requests
        self._claim = claim
        self._prepare = prepare
        self._iterator: AsyncIterator[Event] | None = None

    def __aiter__(self) -> AsyncIterator[Event]:
        if self._iterator is None:
            self._iterator = self._events()
        return self._iterator

    async def aclose(self) -> None:
        if self._iterator is not None:
            await self._iterator.aclose()  # type: ignore[attr-defined]
        if self._claim.session is None:
            self._requests.unclaim(self._claim)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    async def _events(self) -> AsyncIterator[Event]:
        try:
            prepared = await self._prepare()
            events = self._requests.start(self._claim, prepared)
        except BaseException:
            self._requests.unclaim(self._claim)
            raise
        finished = False
        try:
            async with events:
                async for event in events:
                    if isinstance(event, RequestRejected):
                        finished = True
                        raise error_for(event.code, event.message, event.field)
                    # Before yielding: a caller may stop at Finished and never resume us.
                    finished = isinstance(event, Finished)
                    yield event
                    if finished:
                        return
            finished = True  # the session was abandoned at shutdown: nothing left to cancel
            raise RuntimeClosedError("the runtime shut down before the request finished")
        finally:
            if not finished:
                with anyio.CancelScope(shield=True):
                    await self._requests.cancel_claim(self._claim)


class PoolStream:
    """A pool request's events (as `runtime.streams.RequestStream`): leaving early cancels it."""

    def __init__(self, request_id: str, events: AsyncIterator[Event], pool: Any):
        self.request_id = request_id
        self._events = events
        self._pool = pool
        self._finished = False

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        async for event in self._events:
            self._finished = isinstance(event, Finished)
            yield event

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            if not self._finished:
                await self._pool.cancel(self.request_id)
            await self._events.aclose()  # type: ignore[attr-defined]
            self._pool.forget(self.request_id)

    async def __aenter__(self) -> PoolStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()
