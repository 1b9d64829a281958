"""Known tokens: what a row appends after a sampled token without sampling it.

- **jump-forward**: the tokens a request's grammar now forces, emitted at once;
- **strict spans** (fast-forwarding, policy assert): emitted at once;
- **echo spans** (policy verify): forwarded with the next step and emitted as far as the
  tokens the row's sampler draws from that same forward agree (the sampler's `SpanCheck`,
  shared with speculative drafts); the rejected tail's KV is rewound (`settle`).

Either way the tokens go into `Sequence.extra` and are forwarded with the row's next step
(`Engine._dispatch` appends them in one forward over just the rows that have some). The
JSONL trace of fast-forwarded spans is written here too.
"""

from __future__ import annotations

import mlx.core as mx
import structlog

from engine.batch import DecodeBatch
from engine.sequence import InFlight, Sequence
from policies.fill_session import Proposal, trace_record

log = structlog.get_logger(actor="engine")


class KnownTokens:
    def __init__(self, to_text) -> None:
        # Token ids to text, for the trace.
        self._to_text = to_text

    def after_sample(self, seq: Sequence) -> list[int]:
        """The known tokens that follow the token just sampled; returns those emitted now
        (an echo span is emitted only once verified)."""
        if seq.fill is not None and seq.fill.active:
            return self._fast_forward(seq)
        return self._jump_forward(seq)

    def _fast_forward(self, seq: Sequence) -> list[int]:
        """A strict span is emitted now and its KV written with the next step; an echo span is
        forwarded with the next step. Room is kept for the token sampled after the span."""
        fill = seq.fill
        assert fill is not None
        proposal = fill.propose(budget=seq.admit.max_tokens - seq.num_generated - 1)
        if proposal is None:
            return []
        if seq.matcher is not None:
            # A forced tool call's grammar guards the rows: a span ends where it would not accept.
            # (A single accepted token is emitted too: the matcher has taken it.)
            num_ok = next((i for i, t in enumerate(proposal.ids) if not seq.matcher.accept_token(t)), len(proposal.ids))
            proposal = Proposal(proposal.ids[:num_ok], proposal.policy, proposal.origin)
            if not num_ok:
                fill.commit(proposal, 0)
                return []
        seq.extra = list(proposal.ids)
        if proposal.policy == "verify":
            seq.verify = proposal
            return []
        fill.commit(proposal, len(proposal.ids))
        seq.generated += proposal.ids
        seq.num_generated += len(proposal.ids)
        if fill.plan.trace_path:
            seq.trace = proposal
        return list(proposal.ids)

    def _jump_forward(self, seq: Sequence) -> list[int]:
        """Tokens the grammar now forces: emitted at once, their KV written with the next step."""
        if seq.matcher is None or not seq.admit.jump_forward or seq.matcher.is_terminated():
            return []
        forced = []
        for token in seq.matcher.find_jump_forward_tokens()[: seq.admit.max_tokens - seq.num_generated]:
            # Ending the output is the model's choice, never a forced one.
            if token in seq.stop_ids or not seq.matcher.accept_token(token):
                break
            forced.append(token)
        seq.generated += forced
        seq.num_generated += len(forced)
        seq.extra = forced
        return forced

    def trace_choices(self, rows: list[Sequence], appending: list[int], sub_logits: mx.array, in_flight: InFlight) -> None:
        """The model's greedy choice at each appended position, for the fast-forward trace."""
        if any(rows[i].trace is not None or (rows[i].verify is not None and _traced(rows[i])) for i in appending):
            in_flight.appended = [rows[i] for i in appending]
            in_flight.choices = mx.argmax(sub_logits, axis=-1).astype(mx.int32)

    def settle(self, seq: Sequence, batch: DecodeBatch, accepted: dict[int, int], choices: dict[int, list[int]]) -> list[int]:
        """After a step is read: an echo row keeps its agreed prefix (the tail's KV is rewound);
        returns the agreed tokens. Traces the spans the step forwarded."""
        if seq.verify is not None and id(seq) in accepted:
            proposal, seq.verify = seq.verify, None
            n = accepted[id(seq)]
            batch.rewind(seq.request_id, len(proposal.ids) - n)  # the rejected tail's KV
            assert seq.fill is not None
            seq.fill.commit(proposal, n)
            self._trace(seq, proposal, n, choices.get(id(seq)))
            return proposal.ids[:n]
        if seq.trace is not None and id(seq) in choices:
            proposal, seq.trace = seq.trace, None
            self._trace(seq, proposal, len(proposal.ids), choices[id(seq)])
        return []

    def withdraw(self, seq: Sequence) -> None:
        """The row leaves the batch before its echo span was forwarded: offered again later, maybe."""
        if seq.verify is not None:
            assert seq.fill is not None
            seq.fill.commit(seq.verify, 0)
            seq.verify, seq.extra = None, []

    def _trace(self, seq: Sequence, proposal: Proposal, accepted: int, choices: list[int] | None) -> None:
        """Best effort: a trace that cannot be written must not fail the step."""
        assert seq.fill is not None
        path = seq.fill.plan.trace_path
        if not path:
            return
        actual = (choices or [])[: len(proposal.ids)]
        generated = seq.num_generated - (len(proposal.ids) if proposal.policy == "assert" else 0)
        try:
            with open(path, "a") as handle:  # a diagnostic, opt-in: one short append per span
                handle.write(trace_record(seq.request_id, proposal, generated, accepted, actual, self._to_text) + "\n")
        except OSError as exc:
            log.warning("fill_trace_failed", path=path, error=str(exc))


def _traced(seq: Sequence) -> bool:
    return seq.fill is not None and bool(seq.fill.plan.trace_path)
