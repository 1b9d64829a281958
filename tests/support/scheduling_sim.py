"""A fake engine and a step simulator for the scheduling policy's tests (tests/policies).

`FakeEngine` applies `StepPlan`s the way engine/engine.py does, minus the arrays: release, admit,
prefill, then a pipelined decode (see tests/policies/test_scheduling.py's docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.scheduling import SchedulePolicy
from policies.tracked import Ended, Phase, Tracked
from protocols.api import SamplingParams
from protocols.model import AdmitRequest, PrefillReport, RowOutput, StepOutcome, StepPlan

# -- helpers -----------------------------------------------------------------------


def make_tracked(
    request_id: str,
    prompt_len: int,
    max_tokens: int = 4,
    *,
    priority: int = 0,
    stop_token_ids: list[int] | None = None,
    submitted: float = 0.0,
) -> Tracked:
    admit = AdmitRequest(
        request_id=request_id,
        prompt_ids=list(range(1, prompt_len + 1)),
        max_tokens=max_tokens,
        sampling=SamplingParams(),
        seed=0,
        stop_token_ids=stop_token_ids or [],
    )
    return Tracked(admit=admit, submitted=submitted, session=None, priority=priority)


def make_policy(*, max_batch_size: int = 8, max_queued: int = 64, chunk_size: int = 8, token_budget: int = 16, max_skips: int = 4) -> SchedulePolicy:
    return SchedulePolicy(
        max_batch_size=max_batch_size,
        max_queued=max_queued,
        chunk_size=chunk_size,
        token_budget=token_budget,
        max_skips=max_skips,
    )


def default_token(request_id: str, index: int) -> int:
    return 1000 + index


@dataclass
class FakeSeq:
    admit: AdmitRequest
    num_prefilled: int = 0
    num_generated: int = 0
    in_batch: bool = False
    kv: int = 0
    tower_units: int = 0
    denoise_steps: int = 0
    parked: bool = False  # (set by an engine that parks: a parked row does not join)

    @property
    def is_ready(self) -> bool:
        ready = not self.in_batch and not self.parked and self.num_generated == 0 and self.num_prefilled == len(self.admit.prompt_ids) - 1
        return ready and self.admit.denoise is None  # (a denoising request never joins the decode batch)


class FakeEngine:
    """The plan-level behaviour of engine.engine.Engine, without MLX."""

    def __init__(self, tokens=default_token, *, sync_after_prefill: bool = False, tower_units: dict[str, int] | None = None):
        self.tokens = tokens  # (request_id, index of the generated token) -> token id
        self.sync_after_prefill = sync_after_prefill
        self.tower_units = tower_units or {}  # image prompts: vision tower units each takes
        self.seqs: dict[str, FakeSeq] = {}
        self.batch: list[str] = []
        self.in_flight: list[str] | None = None

    def step(self, plan: StepPlan) -> StepOutcome:
        released = [rid for rid in plan.release if self._release(rid)]
        for admit in plan.admit:
            assert admit.request_id not in self.seqs, f"{admit.request_id} admitted twice"
            seeded = admit.prefix_tokens if admit.prefix_entry is not None else 0
            self.seqs[admit.request_id] = FakeSeq(admit, num_prefilled=seeded, tower_units=self.tower_units.get(admit.request_id, 0))
        prefilled = []
        for work in plan.prefill:
            seq = self.seqs[work.request_id]
            if work.encode:
                seq.tower_units -= 1
                prefilled.append(
                    PrefillReport(
                        request_id=work.request_id, processed_tokens=seq.num_prefilled, total_tokens=len(seq.admit.prompt_ids), encoding=seq.tower_units > 0
                    )
                )
                continue
            assert seq.tower_units <= 0, "a chunk of an image prompt before its vision tower ran"
            end = seq.num_prefilled + work.num_tokens
            prompt_len = len(seq.admit.prompt_ids)
            assert work.num_tokens > 0 and end <= prompt_len - (seq.admit.denoise is None), f"prefill {seq.num_prefilled}:{end} of {prompt_len}"
            seq.num_prefilled = seq.kv = end
            prefilled.append(PrefillReport(request_id=work.request_id, processed_tokens=end, total_tokens=prompt_len))
        outputs = self._decode(synchronous=self.sync_after_prefill and bool(prefilled)) if plan.decode else []
        outputs += [self._denoise(rid) for rid in plan.denoise]
        return StepOutcome(
            outputs=outputs,
            prefilled=prefilled,
            released=released,
            num_decode_rows=len(self.batch),
            kv_tokens={rid: s.kv for rid, s in self.seqs.items() if s.kv},
            kv_bytes=sum(s.kv for s in self.seqs.values()),
            step_s=0.0,
        )

    def _denoise(self, rid: str) -> RowOutput:
        """One denoising step: every `canvas_steps`-th finishes a canvas of `canvas_length` tokens."""
        seq = self.seqs[rid]
        assert seq.admit.denoise is not None and seq.num_prefilled == len(seq.admit.prompt_ids)
        seq.denoise_steps += 1
        if seq.denoise_steps % 3:
            return RowOutput(request_id=rid, token_ids=[])
        canvas = min(seq.admit.denoise.canvas_length or 4, seq.admit.max_tokens - seq.num_generated)
        tokens = [self.tokens(rid, seq.num_generated + i) for i in range(canvas)]
        seq.num_generated += canvas
        if seq.num_generated >= seq.admit.max_tokens:
            del self.seqs[rid]
            return RowOutput(request_id=rid, token_ids=tokens, finish_reason="length")
        return RowOutput(request_id=rid, token_ids=tokens)

    def _release(self, rid: str) -> bool:
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return False
        if seq.in_batch:
            self.batch.remove(rid)
        return True

    def _decode(self, *, synchronous: bool) -> list[RowOutput]:
        in_flight = set(self.in_flight or ())
        for rid in list(self.batch):  # retire rows whose in-flight token is their last
            seq = self.seqs[rid]
            if seq.num_generated + (rid in in_flight) >= seq.admit.max_tokens:
                self.batch.remove(rid)
                seq.in_batch = False
        for rid, seq in self.seqs.items():  # join ready rows
            if seq.is_ready:
                self.batch.append(rid)
                seq.in_batch = True
        dispatched = list(self.batch) if self.batch else None
        for rid in self.batch:
            self.seqs[rid].kv += 1
        outputs = self._collect(self.in_flight) if self.in_flight is not None else []
        self.in_flight = dispatched
        if synchronous and dispatched is not None:
            outputs += self._collect(dispatched)
            self.in_flight = None
        return outputs

    def _collect(self, row_ids: list[str]) -> list[RowOutput]:
        outputs = []
        for rid in row_ids:
            seq = self.seqs.get(rid)
            if seq is None:
                continue
            seq.num_generated += 1
            token = self.tokens(rid, seq.num_generated - 1)
            if token in seq.admit.stop_token_ids:
                self._finish(rid)
                outputs.append(RowOutput(request_id=rid, token_ids=[], finish_reason="stop", stop_token_id=token))
            elif seq.num_generated >= seq.admit.max_tokens:
                self._finish(rid)
                outputs.append(RowOutput(request_id=rid, token_ids=[token], finish_reason="length"))
            else:
                outputs.append(RowOutput(request_id=rid, token_ids=[token]))
        return outputs

    def _finish(self, rid: str) -> None:
        if self.seqs[rid].in_batch:
            self.batch.remove(rid)
        del self.seqs[rid]


@dataclass
class StepRecord:
    plan: StepPlan
    outcome: StepOutcome
    ended: list[Ended]
    num_decoding: int  # requests in the decode phase when the plan was made


@dataclass
class Sim:
    """Runs a policy against a FakeEngine, one step at a time, with a fake clock."""

    policy: SchedulePolicy
    engine: FakeEngine = field(default_factory=FakeEngine)
    now: float = 0.0
    tracked: dict[str, Tracked] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    ended: dict[str, Ended] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # Plan the next step before applying this one's outcome where the policy can
    # (`plans_ahead`), as the scheduler does while steps are short.
    run_ahead: bool = False
    ahead: StepPlan | None = None

    def add(self, tracked: Tracked) -> Tracked:
        self.tracked[tracked.request_id] = tracked
        self.policy.enqueue(tracked)
        return tracked

    def admit_all(self) -> list[str]:
        admitted = []
        while (candidate := self.policy.admission_candidate()) is not None:
            self.policy.admit(candidate, self.now)
            admitted.append(candidate.request_id)
        return admitted

    def _num_decoding(self) -> int:
        count = 0
        for rid, t in self.tracked.items():
            if rid in self.ended or "admitted" not in t.timeline:
                continue
            if t.phase is Phase.DECODING or (t.phase is Phase.WAITING and t.prefill_left == 0):
                count += 1
        return count

    def step(self) -> StepRecord:
        self.now += 1.0
        num_decoding = self._num_decoding()
        plan, self.ahead = self.ahead or self.policy.plan(self.now), None
        if self.run_ahead and self.policy.plans_ahead(plan):
            self.ahead = self.policy.plan(self.now)
        outcome = self.engine.step(plan)
        for row in outcome.outputs:
            self.tokens.setdefault(row.request_id, []).extend(row.token_ids)
        ended = self.policy.apply(outcome, self.now)
        for e in ended:
            assert e.tracked.request_id not in self.ended
            self.ended[e.tracked.request_id] = e
        record = StepRecord(plan, outcome, ended, num_decoding)
        self.steps.append(record)
        return record

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            self.admit_all()
            if not self.policy.has_work() and self.ahead is None:
                return
            self.step()
        raise AssertionError("the simulation did not finish")

    def chunks_of(self, request_id: str) -> list[int]:
        return [w.num_tokens for s in self.steps for w in s.plan.prefill if w.request_id == request_id]

    def first_output_step(self, request_id: str) -> int:
        return next(i for i, s in enumerate(self.steps) if any(o.request_id == request_id for o in s.outcome.outputs))

    def end_step(self, request_id: str) -> int:
        return next(i for i, s in enumerate(self.steps) if any(e.tracked.request_id == request_id for e in s.ended))


def prefill_tokens(plan: StepPlan) -> int:
    return sum(w.num_tokens for w in plan.prefill)
