"""The scheduler's decisions, as a synchronous policy with no anyio or mlx.

Requests move WAITING -> PREFILLING -> DECODING and leave when the engine
reports a finish or a release the policy asked for. Each step gets one token
budget shared by decode rows (one token each) and prefill chunks, so a long
prompt delays running streams by at most one chunk. Prefill chunks go to the
request with the least prompt left (short prompts get their first token fast),
except that a request skipped `max_skips` times in a row goes first. An image
prompt's vision tower runs first, a unit per step costed as a chunk (the engine
sizes each unit to about a chunk's compute), so it too delays others by one chunk.
A request's chunk boundaries depend only on its own prompt, never on what
else is running, so its tokens do not depend on the load.

Bulk requests (several choices or prompts of one call, prompt scoring, batch jobs) yield to
interactive ones: while any interactive request is live, bulk ones hold at most
`bulk_share / (1 - bulk_share)` of the interactive requests' batch slots (at least one; the
rest wait, or leave the batch keeping their KV, "held"), and they take at most `bulk_share` of
the time: a step that prefilled for them is charged to them whole, one in which their rows
decoded beside interactive ones is charged what it took beyond an interactive step alone
(a recent average), and no bulk work runs again until the interactive requests have had
`1 - bulk_share` of the time (their rows held meanwhile). Alone, bulk work runs at full speed.
"""

from __future__ import annotations

from collections import deque

from policies.adapters import AdapterSlots
from policies.tracked import Ended, Phase, Tracked
from protocols.model import PrefillWork, StepOutcome, StepPlan


class SchedulePolicy:
    """Admission, batching and prefill/decode interleaving for one engine."""

    def __init__(
        self,
        *,
        max_batch_size: int,
        max_queued: int,
        chunk_size: int,
        token_budget: int,
        max_skips: int = 4,
        adapter_slots: AdapterSlots | None = None,
        bulk_share: float = 1.0,
    ):
        self.max_batch_size = max_batch_size
        self.bulk_share = bulk_share
        # Bulk work waits until then (monotonic seconds) while interactive requests are live; a
        # recent average of the steps that only decoded interactive rows.
        self._bulk_ready_at = 0.0
        self._interactive_step_s: float | None = None
        # Distinct LoRA adapters live requests may hold at once (`lora.max_resident`).
        self.adapter_slots = adapter_slots or AdapterSlots(8)
        self.max_queued = max_queued
        self.chunk_size = chunk_size
        self.token_budget = token_budget
        self.max_skips = max_skips
        self._waiting: deque[Tracked] = deque()
        self._active: dict[str, Tracked] = {}
        self._to_admit: list[Tracked] = []
        self._forgotten: list[str] = []
        self.num_steps = 0
        self.num_finished = 0

    # -- queue ---------------------------------------------------------------

    def can_enqueue(self) -> bool:
        return len(self._waiting) < self.max_queued

    def enqueue(self, tracked: Tracked) -> None:
        if not self.can_enqueue():
            raise OverflowError("admission queue full")
        # Stable by priority: a higher priority goes before lower ones, FIFO within.
        index = len(self._waiting)
        while index > 0 and self._waiting[index - 1].priority < tracked.priority:
            index -= 1
        self._waiting.insert(index, tracked)

    def admission_candidate(self) -> Tracked | None:
        """The next waiting request, if the batch has room for it (parked rows that want to
        rejoin come first)."""
        rejoining = sum(t.parked and not t.paused and not t.held for t in self._active.values())
        if not self._waiting or self._num_slots_used() + rejoining >= self.max_batch_size:
            return None
        cap = self.bulk_cap()
        bulk_full = cap is not None and sum(t.bulk and t.phase is not Phase.RELEASING for t in (*self._active.values(), *self._to_admit)) >= cap
        # Bulk requests beyond their slots wait; interactive ones behind them go first.
        head = next((t for t in self._waiting if not (t.bulk and bulk_full)), None)
        if head is None:
            return None
        live = [t.admit.adapter for t in (*self._active.values(), *self._to_admit)]
        return head if self.adapter_slots.allows(head.admit.adapter, live) else None

    def bulk_cap(self) -> int | None:
        """The batch slots bulk requests may hold now; None while no interactive request is
        live (or `bulk_share` is 1): then they may hold any."""
        interactive = self.num_interactive()
        if self.bulk_share >= 1 or not interactive:
            return None
        return max(1, int(interactive * self.bulk_share / (1 - self.bulk_share)))

    def _bulk_slots_now(self, now: float) -> int | None:
        """`bulk_cap()`, or none while bulk work waits for its turn beside interactive rows that
        are running (only they make the time pass that ends the wait)."""
        cap = self.bulk_cap()
        if cap is not None and now < self._bulk_ready_at and self._interactive_running():
            return 0
        return cap

    def _interactive_running(self) -> bool:
        return any(not t.bulk and not t.parked and t.phase in (Phase.DECODING, Phase.PREFILLING, Phase.DENOISING) for t in self._active.values())

    def num_interactive(self) -> int:
        """Interactive requests admitted or running (not those ending), and those waiting while the
        batch has no slot for them. (One waiting for KV room with slots free does not count: holding
        bulk rows for it would only slow the ones whose ends make that room.)"""
        admitted = sum(not t.bulk and t.phase is not Phase.RELEASING for t in (*self._to_admit, *self._active.values()))
        rejoining = sum(t.parked and not t.paused and not t.held for t in self._active.values())
        full = self._num_slots_used() + rejoining >= self.max_batch_size
        return admitted + (sum(not t.bulk for t in self._waiting) if full else 0)

    def _num_slots_used(self) -> int:
        """Batch slots: every admitted request but the parked ones (they keep only their KV)."""
        return sum(not t.parked for t in self._active.values()) + len(self._to_admit)

    def admit(self, tracked: Tracked, now: float) -> None:
        self._waiting.remove(tracked)
        tracked.stamp("admitted", now)
        self._to_admit.append(tracked)

    def reject_waiting(self, tracked: Tracked) -> None:
        self._waiting.remove(tracked)

    # -- early ends ----------------------------------------------------------

    def end_early(self, request_id: str, reason: str, *, keep_checkpoint: bool = False) -> Ended | None:
        """Cancel (or stop) a request. Waiting ones end now; admitted ones after a release step."""
        for queue in (self._waiting, self._to_admit):
            for tracked in queue:
                if tracked.request_id == request_id:
                    queue.remove(tracked)
                    tracked.keep_checkpoint = keep_checkpoint
                    self.num_finished += 1
                    return Ended(tracked, reason)
        active = self._active.get(request_id)
        if active is not None and active.release_reason is None:
            active.keep_checkpoint = keep_checkpoint
            active.release_reason = reason
            active.phase = Phase.RELEASING
        return None

    # -- stepping ------------------------------------------------------------

    def is_tracked(self, request_id: str) -> bool:
        """Waiting, about to be admitted, or running (possibly still releasing)."""
        return request_id in self._active or any(t.request_id == request_id for t in [*self._waiting, *self._to_admit])

    def set_paused(self, request_id: str, paused: bool) -> None:
        for tracked in [*self._waiting, *self._to_admit, *self._active.values()]:
            if tracked.request_id == request_id:
                tracked.paused = paused

    def has_work(self) -> bool:
        return bool(self._to_admit) or any(not t.is_idle for t in self._active.values()) or bool(self._held_rejoining())

    def _held_rejoining(self, now: float | None = None) -> list[Tracked]:
        """Held bulk rows that may rejoin the batch (at `now`: and whose turn it is), within the
        slots bulk may hold."""
        held = [t for t in self._active.values() if t.held and not t.paused and t.phase is not Phase.RELEASING]
        cap = self.bulk_cap() if now is None else self._bulk_slots_now(now)
        if cap is None or not held:
            return held
        running = sum(t.bulk and not t.parked for t in self._active.values())
        return held[: max(0, cap - running)]

    def plan(self, now: float) -> StepPlan:
        """The next step. Call only when `has_work()`."""
        release = [t.request_id for t in self._active.values() if t.phase is Phase.RELEASING]
        admit = []
        for tracked in self._to_admit:
            tracked.planned = True
            tracked.phase = Phase.PREFILLING if tracked.prefill_left > 0 else tracked.generating
            vision = tracked.admit.vision
            tracked.encoding = vision is not None and vision.needs_tower(tracked.admit.prompt_ids, tracked.num_prefilled)
            self._active[tracked.request_id] = tracked
            admit.append(tracked.admit)
        self._to_admit.clear()
        park, unpark = self._plan_parking(now)
        decoding = [t for t in self._active.values() if t.phase is Phase.DECODING and not t.held]
        denoise = self._plan_denoise(self.token_budget - len(decoding))
        budget = self.token_budget - len(decoding) - sum(self._canvas_cost(self._active[rid]) for rid in denoise)
        prefill = self._plan_prefill(budget, now)
        # A parked row may still have a token in flight: decode runs until it is read.
        decode = any(t.phase is Phase.DECODING and not t.is_idle for t in self._active.values())
        self.num_steps += 1
        checkpoint = self._plan_checkpoints()
        forget, self._forgotten = self._forgotten, []
        return StepPlan(
            release=release,
            admit=admit,
            prefill=prefill,
            decode=decode,
            checkpoint=checkpoint,
            park=park,
            unpark=unpark,
            forget_checkpoints=forget,
            denoise=denoise,
            bulk_only=not self.num_interactive() and any(t.bulk for t in self._active.values()),
        )

    def plans_ahead(self, plan: StepPlan) -> bool:
        """Whether the plan after `plan` can be made before `plan`'s outcome is applied: `plan`
        only decodes, and nothing but that outcome can change the next one (no request waits
        for admission or a batch slot, none is prefilling, paused, parked, releasing or taking
        checkpoints). The next plan is then a decode step; rows the outcome ends are the
        engine's to drop, and anything that arrives meanwhile goes in the plan after it."""
        if not plan.decode or plan.admit or plan.prefill or plan.release or plan.park or plan.unpark or plan.checkpoint or plan.denoise:
            return False
        if plan.forget_checkpoints or self._to_admit or self._forgotten or self.admission_candidate() is not None:
            return False
        active = self._active.values()
        # (Held bulk rows stay out until a plan after an outcome lets them back.)
        return bool(active) and all(t.phase is Phase.DECODING and not (t.paused or (t.parked and not t.held) or t.checkpoint_every) for t in active)

    def forget_checkpoint(self, request_id: str) -> None:
        """The request's checkpoint is deleted: the next plan says so (to follower ranks)."""
        self._forgotten.append(request_id)

    def _plan_parking(self, now: float) -> tuple[list[str], list[str]]:
        """Rows whose callers fell behind leave the batch, and decoding bulk rows beyond the slots
        bulk may hold (the latest admitted first; all of them while bulk waits for its turn);
        caught-up ones rejoin while there is room."""
        park = []
        for tracked in self._active.values():
            if tracked.paused and not tracked.parked and tracked.phase is not Phase.RELEASING:
                tracked.parked, tracked.parked_steps = True, 0
                park.append(tracked.request_id)
        cap = self._bulk_slots_now(now)
        if cap is not None:
            running = [t for t in self._active.values() if t.bulk and not t.parked and t.phase is not Phase.RELEASING]
            for tracked in running[cap:]:
                if tracked.phase is Phase.DECODING:
                    tracked.parked, tracked.held, tracked.parked_steps = True, True, 0
                    park.append(tracked.request_id)
        rejoining = {id(t) for t in self._held_rejoining(now)}
        unpark, slots = [], self._num_slots_used()
        for tracked in self._active.values():
            if slots >= self.max_batch_size:
                break
            if tracked.parked and not tracked.paused and (not tracked.held or id(tracked) in rejoining):
                tracked.parked, tracked.held, tracked.parked_steps = False, False, 0
                unpark.append(tracked.request_id)
                slots += 1
        return park, unpark

    def _plan_checkpoints(self) -> list[str]:
        due = []
        for tracked in self._active.values():
            # A parked row is out of the batch: its checkpoint waits until it decodes again.
            if tracked.phase is Phase.DECODING and not tracked.parked and tracked.checkpoint_every and tracked.num_generated >= tracked.next_checkpoint:
                due.append(tracked.request_id)
                while tracked.next_checkpoint <= tracked.num_generated:
                    tracked.next_checkpoint += tracked.checkpoint_every
        return due

    def _plan_prefill(self, budget: int, now: float) -> list[PrefillWork]:
        # Bulk prefill waits its turn while interactive requests are live (it does not age), and
        # then takes one chunk a step.
        bulk_waits = self._bulk_slots_now(now) == 0
        prefilling = [t for t in self._active.values() if t.phase is Phase.PREFILLING and not (t.bulk and bulk_waits)]
        # Requests skipped max_skips times go first, the longest-starved first.
        prefilling.sort(key=self._prefill_order)
        work: list[PrefillWork] = []
        bulk_prefilled = False
        bulk_yields = self.bulk_cap() is not None
        for tracked in prefilling:
            if tracked.bulk and bulk_yields and bulk_prefilled:
                continue  # beside interactive requests, one bulk chunk a step (a short stall)
            if tracked.encoding:  # a unit of its vision tower, costed as a chunk
                if self.chunk_size > budget and work:
                    tracked.num_skips += 1
                    continue
                budget -= self.chunk_size
                tracked.num_skips = 0
                bulk_prefilled |= tracked.bulk
                tracked.open_encode = now
                tracked.stamp("prefill_started", now)
                work.append(PrefillWork(request_id=tracked.request_id, num_tokens=self.chunk_size, encode=True))
                continue
            chunk = min(self.chunk_size, tracked.prefill_left)
            snapshot = tracked.admit.snapshot_at
            if snapshot is not None and tracked.num_prefilled < snapshot < tracked.num_prefilled + chunk:
                chunk = snapshot - tracked.num_prefilled  # the snapshot is taken at a chunk's end
            if chunk > budget and work:
                tracked.num_skips += 1
                continue
            budget -= chunk
            tracked.num_skips = 0
            bulk_prefilled |= tracked.bulk
            tracked.open_chunk = (now, chunk, tracked.num_prefilled)
            tracked.num_prefilled += chunk
            tracked.stamp("prefill_started", now)
            work.append(PrefillWork(request_id=tracked.request_id, num_tokens=chunk))
            if tracked.prefill_left == 0:
                tracked.phase = tracked.generating
        return work

    def _plan_denoise(self, budget: int) -> list[str]:
        """Denoising requests (not parked) that take a denoising step this plan, each costed as
        its canvas's positions (a forward over them), the first always; the longest-waiting
        first, so that none starves while others step."""
        denoising = sorted((t for t in self._active.values() if t.phase is Phase.DENOISING and not t.parked), key=lambda t: -t.num_skips)
        chosen: list[str] = []
        for tracked in denoising:
            cost = self._canvas_cost(tracked)
            if cost > budget and chosen:
                tracked.num_skips += 1
                continue
            budget -= cost
            tracked.num_skips = 0
            tracked.num_denoise_steps += 1
            chosen.append(tracked.request_id)
        return chosen

    def _canvas_cost(self, tracked: Tracked) -> int:
        options = tracked.admit.denoise
        return (options.canvas_length or self.chunk_size) if options is not None else 0

    def _prefill_order(self, tracked: Tracked) -> tuple:
        aged = tracked.num_skips >= self.max_skips
        return (not aged, -tracked.num_skips if aged else 0, -tracked.priority, tracked.prefill_left)

    def apply(self, outcome: StepOutcome, now: float) -> list[Ended]:
        """Record what a step did; returns the requests that ended in it."""
        ended = []
        self._charge_bulk(outcome, now)
        for tracked in self._active.values():
            tracked.parked_steps += tracked.parked
            tracked.close_chunk(now)
        for report in outcome.prefilled:
            if (encoded := self._active.get(report.request_id)) is not None:
                encoded.encoding = report.encoding
        for rid in outcome.released:
            tracked = self._active.pop(rid)
            ended.append(Ended(tracked, tracked.release_reason or "cancelled"))
        for row in outcome.outputs:
            running = self._active.get(row.request_id)
            if running is None:
                continue
            tracked = running
            tracked.num_generated += len(row.token_ids) + (row.stop_token_id is not None)
            if row.token_ids or row.finish_reason:
                tracked.stamp("first_token", now)
                tracked.timeline["last_token"] = now
            if row.finish_reason is not None:
                del self._active[row.request_id]
                code = row.error_code or ("internal" if row.error else None)
                ended.append(Ended(tracked, tracked.release_reason or row.finish_reason, row.stop_token_id, row.error, code))
        self.num_finished += len(ended)
        return ended

    def _charge_bulk(self, outcome: StepOutcome, now: float) -> None:
        """Charge a step's time to the bulk work it did beside interactive requests: bulk waits
        until the others have had (1 - share) of the time for each second charged (charges add up). A step that
        prefilled for bulk work is charged whole; one where bulk rows only decoded beside
        interactive ones, what it took beyond a recent interactive step alone (whole until one was
        seen). Steps that decoded only interactive rows keep that average. (Read from the
        outcome: with a plan made ahead, the plan last made is not the step reported.)"""
        prefilled = [self._active.get(r.request_id) for r in outcome.prefilled]
        decoded = [self._active.get(r.request_id) for r in outcome.outputs]
        bulk_prefilled = any(t is not None and t.bulk for t in prefilled)
        bulk_decoded = any(t is not None and t.bulk for t in decoded)
        if self.bulk_cap() is not None and (bulk_prefilled or bulk_decoded):
            alone = self._interactive_step_s
            charged = outcome.step_s if bulk_prefilled or alone is None else max(0.0, outcome.step_s - alone)
            self._bulk_ready_at = max(self._bulk_ready_at, now) + charged * (1 - self.bulk_share) / self.bulk_share
        elif outcome.step_s > 0 and decoded and not prefilled and not bulk_decoded:
            alone = self._interactive_step_s
            self._interactive_step_s = outcome.step_s if alone is None else 0.8 * alone + 0.2 * outcome.step_s

    def get(self, request_id: str) -> Tracked | None:
        return self._active.get(request_id)

    def counts(self) -> dict[str, int]:
        phases = [t.phase for t in self._active.values()]
        return {
            "waiting": len(self._waiting) + len(self._to_admit),
            "prefilling": phases.count(Phase.PREFILLING),
            "decoding": phases.count(Phase.DECODING) + phases.count(Phase.DENOISING) + phases.count(Phase.RELEASING),
            "paused": sum(t.parked and not t.held for t in self._active.values()),
            "held": sum(t.held for t in self._active.values()),
        }

    def fail_all(self, error: str, code: str = "internal") -> list[Ended]:
        """The engine dropped everything: every admitted request ends in error."""
        # Requests already ending keep their reason and have no error (a cancel stays a cancel,
        # and deletes its checkpoint as a cancel does).
        ended = [
            Ended(t, t.release_reason or "error", error=None if t.release_reason else error, error_code=None if t.release_reason else code)
            for t in self._active.values()
        ]
        self._active.clear()
        self.num_finished += len(ended)
        return ended
