"""Tests for the message types: msgspec round-trips, tagging and strict decoding."""

from __future__ import annotations

import msgspec
import pytest

from protocols.api import (
    DenoiseProgress,
    Event,
    Finished,
    GenerateRequest,
    PrefillProgress,
    SamplingParams,
    Timings,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from protocols.model import (
    AdmitRequest,
    PrefillReport,
    PrefillWork,
    RowOutput,
    StepOutcome,
    StepPlan,
)
from protocols.session import RequestFinished, RequestTimeline, TokensGenerated

CODECS = [
    pytest.param(msgspec.json.encode, msgspec.json.decode, id="json"),
    pytest.param(msgspec.msgpack.encode, msgspec.msgpack.decode, id="msgpack"),
]


def make_admit(request_id: str = "r1") -> AdmitRequest:
    return AdmitRequest(
        request_id=request_id,
        prompt_ids=[1, 2, 3],
        max_tokens=16,
        sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=5),
        seed=5,
        stop_token_ids=[2, 7],
        logprobs=True,
        top_logprobs=3,
    )


EVENTS = [
    TokenDelta(request_id="a", token_ids=[5, 6], text="hi"),
    TokenDelta(
        request_id="a",
        token_ids=[5],
        text="h\u00e9\U0001f600",
        logprobs=[
            TokenLogprob(
                token_id=5,
                logprob=-0.25,
                top=[TopLogprob(token_id=5, logprob=-0.25), TopLogprob(token_id=9, logprob=-1.5)],
            )
        ],
    ),
    PrefillProgress(request_id="b", processed_tokens=32, total_tokens=100),
    DenoiseProgress(request_id="b", canvas=2, step=7, revealed=40, positions=64),
    Finished(
        request_id="c",
        finish_reason="stop",
        usage=Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=2),
        timings=Timings(queue_s=0.5, ttft_s=0.75, total_s=2.0, prefill_tokens_per_s=100.0, decode_tokens_per_s=25.0),
        stop_sequence="</s>",
    ),
    Finished(request_id="d", finish_reason="error", usage=Usage(prompt_tokens=1, completion_tokens=0), error="boom"),
]


# -- defaults ------------------------------------------------------------------


def test_generate_request_defaults():
    request = GenerateRequest()
    assert request.max_tokens is None
    assert request.sampling == SamplingParams()
    assert request.sampling.temperature == 0.0
    assert request.sampling.seed is None
    assert request.prompt is None and request.prompt_ids is None and request.messages is None
    assert request.stop == [] and request.stop_token_ids == []
    assert request.priority == 0
    assert request.report_progress is False


def test_generate_request_list_defaults_are_not_shared():
    a, b = GenerateRequest(), GenerateRequest()
    a.stop.append("x")
    assert b.stop == []


def test_generate_request_decodes_from_empty_object():
    assert msgspec.json.decode(b"{}", type=GenerateRequest) == GenerateRequest()


def test_messages_are_frozen():
    delta = TokenDelta(request_id="a", token_ids=[1], text="x")
    with pytest.raises(AttributeError):
        delta.text = "y"  # type: ignore[misc]


# -- round trips -----------------------------------------------------------------


@pytest.mark.parametrize(("encode", "decode"), CODECS)
def test_generate_request_round_trip(encode, decode):
    request = GenerateRequest(
        messages=[{"role": "user", "content": "hello \u00fc"}],
        max_tokens=12,
        sampling=SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.05, repetition_penalty=1.1, seed=42),
        stop=["</s>", "\n\n"],
        stop_token_ids=[0, 2],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=5,
        request_id="req-1",
        priority=3,
        report_progress=True,
    )
    decoded = decode(encode(request), type=GenerateRequest)
    assert decoded == request
    assert decoded.sampling.seed == 42
    assert isinstance(decoded.sampling, SamplingParams)


@pytest.mark.parametrize(("encode", "decode"), CODECS)
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_event_round_trip_through_union(encode, decode, event):
    decoded = decode(encode(event), type=Event)
    assert type(decoded) is type(event)
    assert decoded == event


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_event_tag_is_class_name_under_type(event):
    raw = msgspec.json.decode(msgspec.json.encode(event))
    assert raw["type"] == type(event).__name__


def test_event_union_decodes_by_tag_from_hand_written_json():
    text = b'{"type": "PrefillProgress", "request_id": "x", "processed_tokens": 3, "total_tokens": 9}'
    assert msgspec.json.decode(text, type=Event) == PrefillProgress(request_id="x", processed_tokens=3, total_tokens=9)


def test_finished_defaults_after_decoding():
    text = b'{"type": "Finished", "request_id": "x", "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 4}}'
    finished = msgspec.json.decode(text, type=Event)
    assert isinstance(finished, Finished)
    assert finished.timings == Timings()
    assert finished.usage.cached_tokens == 0
    assert finished.stop_sequence is None and finished.error is None


@pytest.mark.parametrize(("encode", "decode"), CODECS)
def test_step_plan_round_trip(encode, decode):
    plan = StepPlan(
        release=["old"],
        admit=[make_admit("r1"), make_admit("r2")],
        prefill=[PrefillWork(request_id="r1", num_tokens=8)],
        decode=True,
    )
    decoded = decode(encode(plan), type=StepPlan)
    assert decoded == plan
    assert decoded.admit[0].sampling.top_k == 40


def test_step_plan_defaults():
    plan = StepPlan()
    assert plan.release == [] and plan.admit == [] and plan.prefill == [] and plan.decode is False


@pytest.mark.parametrize(("encode", "decode"), CODECS)
def test_step_outcome_round_trip(encode, decode):
    outcome = StepOutcome(
        outputs=[
            RowOutput(request_id="r1", token_ids=[11], logprobs=[TokenLogprob(token_id=11, logprob=-0.5)]),
            RowOutput(request_id="r2", token_ids=[12], finish_reason="length"),
            RowOutput(request_id="r3", token_ids=[], finish_reason="stop", stop_token_id=2),
        ],
        prefilled=[PrefillReport(request_id="r4", processed_tokens=8, total_tokens=20)],
        released=["r5"],
        num_decode_rows=3,
        kv_tokens={"r1": 10, "r4": 8},
        kv_bytes=4096,
        step_s=0.0125,
    )
    assert decode(encode(outcome), type=StepOutcome) == outcome


@pytest.mark.parametrize(("encode", "decode"), CODECS)
def test_admit_request_round_trip(encode, decode):
    admit = make_admit()
    assert decode(encode(admit), type=AdmitRequest) == admit


@pytest.mark.parametrize(("encode", "decode"), CODECS)
def test_session_messages_round_trip(encode, decode):
    finished = RequestFinished(
        request_id="r",
        finish_reason="cancelled",
        timeline=RequestTimeline(submitted=1.0, admitted=1.5, first_token=2.0),
    )
    tokens = TokensGenerated(request_id="r", token_ids=[1, 2])
    union = TokensGenerated | RequestFinished
    assert decode(encode(finished), type=union) == finished
    assert decode(encode(tokens), type=union) == tokens


# -- strict decoding -------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "type_"),
    [
        (b'{"prompt": "x", "bogus": 1}', GenerateRequest),
        (b'{"sampling": {"temperature": 0.5, "tempreature": 1.0}}', GenerateRequest),
        (b'{"type": "TokenDelta", "request_id": "a", "token_ids": [], "text": "", "extra": 0}', Event),
        (
            b'{"type": "Finished", "request_id": "a", "finish_reason": "stop", "usage": {"prompt_tokens": 1, "completion_tokens": 1, "reasoning_tokens": 0}}',
            Event,
        ),
        (b'{"request_id": "a", "num_tokens": 3, "priority": 1}', PrefillWork),
        (b'{"decode": true, "sleep": true}', StepPlan),
    ],
)
def test_unknown_fields_are_rejected(payload, type_):
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.json.decode(payload, type=type_)


def test_unknown_fields_rejected_through_msgpack():
    payload = msgspec.msgpack.encode({"request_id": "a", "num_tokens": 3, "nope": True})
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.msgpack.decode(payload, type=PrefillWork)


@pytest.mark.parametrize(
    ("payload", "type_", "where"),
    [
        (b'{"max_tokens": "ten"}', GenerateRequest, "max_tokens"),
        (b'{"prompt_ids": [1, "2"]}', GenerateRequest, "prompt_ids"),
        (b'{"sampling": {"temperature": "hot"}}', GenerateRequest, "sampling.temperature"),
        (b'{"stop": "</s>"}', GenerateRequest, "stop"),
        (b'{"logprobs": 1}', GenerateRequest, "logprobs"),
        (b'{"priority": true}', GenerateRequest, "priority"),
        (b'{"type": "PrefillProgress", "request_id": 7, "processed_tokens": 1, "total_tokens": 2}', Event, "request_id"),
        (
            b'{"type": "Finished", "request_id": "a", "finish_reason": "timeout", "usage": {"prompt_tokens": 1, "completion_tokens": 1}}',
            Event,
            "finish_reason",
        ),
        (b'{"request_id": "a", "num_tokens": 1.5}', PrefillWork, "num_tokens"),
    ],
)
def test_wrong_types_are_rejected(payload, type_, where):
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(payload, type=type_)
    assert f"$.{where}" in str(info.value)


def test_unknown_event_tag_is_rejected():
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'Nope'"):
        msgspec.json.decode(b'{"type": "Nope", "request_id": "a"}', type=Event)


def test_missing_required_field_is_rejected():
    with pytest.raises(msgspec.ValidationError, match="missing required field `usage`"):
        msgspec.json.decode(b'{"type": "Finished", "request_id": "a", "finish_reason": "stop"}', type=Event)


def test_records_are_untagged_and_messages_tagged():
    assert "type" not in msgspec.json.decode(msgspec.json.encode(PrefillWork(request_id="a", num_tokens=1)))
    raw = msgspec.json.decode(msgspec.json.encode(TokensGenerated(request_id="a", token_ids=[])))
    assert raw["type"] == "TokensGenerated"


def test_every_error_class_round_trips_through_the_one_code_table():
    from protocols import errors

    for cls in (
        errors.InvalidRequestError,
        errors.RequestTooLargeError,
        errors.DuplicateRequestError,
        errors.ServerBusyError,
        errors.RuntimeClosedError,
        errors.InternalError,
        errors.CheckpointError,
        errors.CheckpointNotFoundError,
    ):
        original = cls("message", field="f") if issubclass(cls, errors.InvalidRequestError) else cls("message")
        again = errors.error_for(errors.error_code(original), "message", getattr(original, "field", None))
        assert type(again) is cls and getattr(again, "field", None) == getattr(original, "field", None)
    # Subclasses without codes of their own travel as their family's code.
    assert errors.error_code(errors.CorruptCheckpointError("x")) == "checkpoint_invalid"
    assert errors.error_code(ValueError("a bug")) == "internal"
    assert isinstance(errors.error_for("frame_too_large", "m"), errors.ServerError)


def test_every_event_crosses_the_socket_wire():
    """Each event kind a request streams is a message the socket server may send."""
    from protocols.wire import ServerMessage

    for event in EVENTS:
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=ServerMessage) == event
