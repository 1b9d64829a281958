"""A decode step's results on the host, and what each row emits (`RowOutput`).

`read_step` reads a dispatched step back (the one host round trip); `account` records a row's
sampled token on its request and says what it emits and whether it ends; `exhausted` and
`failed` are the outputs of a row that ends with an error. None of these releases a request:
the engine does, for every output with a `finish_reason`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.forward import host, read_logprobs
from engine.known import KnownTokens
from engine.sequence import InFlight, Sequence
from protocols.api import TokenLogprob
from protocols.model import RowOutput


@dataclass
class StepRead:
    """A step's sampled tokens (with their logprobs), the greedy choices of rows that appended
    known tokens, how many tokens of each checked span were kept, and which rows had no token
    left to sample. `choices` and `accepted` are keyed by `id(seq)`."""

    tokens: list[int]
    logprobs: list[TokenLogprob] | None
    choices: dict[int, list[int]]
    accepted: dict[int, int]
    exhausted: list[bool]


def read_step(in_flight: InFlight) -> StepRead:
    """Read a dispatched step back; a checked span's kept tokens count as sampled."""
    assert in_flight.result is not None
    result = in_flight.result
    tokens = host(result.tokens)
    logprobs = read_logprobs(result, tokens)
    choices = dict(zip(map(id, in_flight.appended), host(in_flight.choices))) if in_flight.choices is not None else {}
    accepted = dict(zip(map(id, in_flight.verified), host(in_flight.accepted))) if in_flight.accepted is not None else {}
    exhausted = host(result.exhausted) if result.exhausted is not None else [False] * len(tokens)
    for sampling, seq in zip(in_flight.verified_sampling, in_flight.verified):
        sampling.num_sampled += accepted[id(seq)]
    return StepRead(tokens, logprobs, choices, accepted, exhausted)


def account(seq: Sequence, token: int, logprob: TokenLogprob | None, agreed: list[int], known: KnownTokens) -> RowOutput:
    """Record a sampled token (after the echo tokens the model agreed with, if any) and the
    known tokens it forces; the output has a `finish_reason` when the request ends with it.
    Raises when the request's grammar rejects the token (it alone fails)."""
    seq.generated += agreed
    seq.num_generated += len(agreed) + 1
    seq.generated.append(token)
    admit = seq.admit
    if seq.fill is not None and token not in seq.stop_ids:
        seq.fill.observe(token)
    if seq.spec is not None:
        seq.spec.record_step(len(agreed) + 1)
        if seq.lookup is not None:
            seq.lookup.observe([*agreed, token])

    def output(token_ids: list[int], **kw) -> RowOutput:
        fill = seq.fill.snapshot() if seq.fill else None
        return RowOutput(request_id=seq.request_id, token_ids=token_ids, fill=fill, spec=seq.spec.snapshot() if seq.spec else None, **kw)

    if seq.matcher is not None and not seq.matcher.accept_token(token):
        raise RuntimeError(f"the grammar rejected sampled token {token}")
    wanted = None
    if logprob is not None and (admit.logprobs or admit.top_logprobs):
        top = logprob.top[: admit.top_logprobs] if admit.top_logprobs and logprob.top else None
        wanted = [TokenLogprob(token_id=token, logprob=logprob.logprob, top=top)]
    if token in seq.stop_ids:
        return output(list(agreed), finish_reason="stop", stop_token_id=token)
    if seq.matcher is not None and seq.matcher.is_terminated():
        # The grammar is complete: no further step is built for this row.
        return output([*agreed, token], logprobs=wanted, finish_reason="stop")
    if seq.num_generated >= admit.max_tokens:
        return output([*agreed, token], logprobs=wanted, finish_reason="length")
    forced = known.after_sample(seq)
    if seq.lookup is not None and forced:
        seq.lookup.observe(forced)
    if seq.num_generated >= admit.max_tokens:
        return output([*agreed, token, *forced], finish_reason="length")
    return output([*agreed, token, *forced], logprobs=wanted)


def exhausted(seq: Sequence) -> RowOutput:
    """The request's own logits controls (with its grammar) left no token to sample: it ends
    with an `invalid_request` error (the engine does not keep its KV)."""
    why = "no token is left to sample: the request's allowed_token_ids, bad_words and min_tokens (with its grammar) exclude every token"
    return RowOutput(request_id=seq.request_id, token_ids=[], finish_reason="error", error=why, error_code="invalid_request")


def failed(seq: Sequence, exc: Exception) -> RowOutput:
    """The request ends with `error` (the engine does not keep its KV: its state is suspect)."""
    return RowOutput(request_id=seq.request_id, token_ids=[], finish_reason="error", error=str(exc) or type(exc).__name__)
