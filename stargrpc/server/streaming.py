"""How a run's events go out on Execute and WatchRun streams.

Two things keep the per-event cost of a stream low:

- **Each event is serialised once.** ``ExecuteResponse`` and ``WatchRunResponse`` hold one
  field, ``RunEvent event = 1``, so both have the same wire form: that field's tag and
  length, then the event's bytes. The log keeps each event's bytes once they are made
  (:meth:`stargrpc.stores.base.RunLog.encoded`: the embedded log shares them among every
  stream of the run; a log read from Redis passes on the bytes Redis gave), and a
  stream yields :class:`EventFrame` objects that :func:`serialize_response` passes to gRPC
  as they are — instead of copying each event into a new response message and serialising
  that again for every stream.
- **DELTA coalescing, under backpressure, on request** (``coalesce_deltas`` on the
  request). gRPC pays per *message*, not per byte, so when a stream falls behind its run
  (it comes back from sending and finds several events waiting), consecutive DELTAs of
  the same step and channel among them go out as ONE message: texts concatenated in
  order, at most :data:`MAX_COALESCED_BYTES` of text, with ``RunEvent.first_seq`` set so
  the message says which events it stands for (``first_seq..seq``). Nothing is reordered
  or dropped, and nothing is merged across any other event. A reader that keeps up finds
  one event waiting at a time and gets one message per event, as without coalescing.

The Result is never framed: it goes out as a real response message of the call's type
(Execute first awaits its call record's ``before_result`` with it: the audit commits the
record of the call there, before the client can see the Result). Interceptors that look at other
responses get an :class:`EventFrame`, whose :attr:`~EventFrame.event` is the RunEvent sent.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing
from typing import Any, NamedTuple

from google.protobuf.message import Message
from google.protobuf.wrappers_pb2 import BytesValue

from stargrpc.stores.base import RunLog
from stargrpc.v1 import events_pb2, tool_service_pb2

#: Most text (UTF-8 bytes) one coalesced DELTA message carries; a single larger delta
#: still goes out whole, alone.
MAX_COALESCED_BYTES = 64 * 1024

#: The tag of field 1, length-delimited (``event`` of both responses).
_FIELD_1 = b"\x0a"

#: The response messages of the two streaming calls: one ``RunEvent event = 1`` each.
EventResponse = tool_service_pb2.ExecuteResponse | tool_service_pb2.WatchRunResponse


class EventFrame(NamedTuple):
    """One response of an event stream, already serialised (a tuple: made for every event,
    so it must be cheap to make).

    Attributes:
        event: The RunEvent it carries (a merged one when it stands for several DELTAs),
            for interceptors and tests that look at what is sent; never modify it.
        data: The serialised response — the same bytes for ``ExecuteResponse`` and
            ``WatchRunResponse``.
        events: How many events of the run's log it stands for (1 unless coalesced).
    """

    event: events_pb2.RunEvent
    data: bytes
    events: int = 1


#: What an event stream yields: frames, and the Result as a real response message.
StreamedResponse = EventFrame | EventResponse


def frame(event_bytes: bytes) -> bytes:
    """The wire form of a response holding the event serialised as ``event_bytes``.

    ``BytesValue`` is ``bytes value = 1``: its wire form is field 1's tag, the length and
    the bytes — exactly that of ``ExecuteResponse{event}`` — so protobuf writes the frame.
    Most events are small enough for a one-byte length, which is written here directly:
    cheaper than a ``BytesValue`` made and serialised, and this runs for every event sent
    (measured in ``bench/README.md``).
    """
    if len(event_bytes) < 0x80:
        return _FIELD_1 + bytes((len(event_bytes),)) + event_bytes
    return BytesValue(value=event_bytes).SerializeToString()


def serialize_response(message: StreamedResponse | Message) -> bytes:
    """The response serializer of ToolService: frames pass through as they are, any other
    message is serialised."""
    if isinstance(message, EventFrame):
        return message.data
    return message.SerializeToString()


async def event_responses(log: RunLog, after_seq: int,
                          response_type: Callable[..., EventResponse], *,
                          coalesce: bool = False, max_lag: int = 0,
                          count: Callable[[int], Any] | None = None
                          ) -> AsyncIterator[StreamedResponse]:
    """The responses of a stream of ``log``'s events after ``after_seq``, to its Result.

    Args:
        log: The run's log.
        after_seq: Replay from the event after this one.
        response_type: ``ExecuteResponse`` or ``WatchRunResponse``, for the Result.
        coalesce: Merge consecutive waiting DELTAs of a step and channel (module docstring).
        max_lag: As for :meth:`stargrpc.stores.base.RunLog.follow`.
        count: Called with the number of events each response stood for, once it is sent.

    Raises:
        RequestError: From the log (the watcher fell too far behind, a store went away).
    """
    sent = 0  # events sent and not counted yet: counted once per batch (a lock each time)
    try:
        async with aclosing(log.follow_batches(after_seq, max_lag=max_lag)) as batches:
            async for batch in batches:
                for response in batch_responses(log, batch, coalesce):
                    if response is None:  # the Result, always the last event of a run
                        yield response_type(event=batch[-1])
                        sent += 1
                        return
                    yield response
                    sent += response.events
                if count is not None and sent:
                    count(sent)
                    sent = 0
    finally:
        if count is not None and sent:
            count(sent)


def batch_responses(log: RunLog, batch: Sequence[events_pb2.RunEvent], coalesce: bool
                    ) -> Iterator[EventFrame | None]:
    """The frames of one batch of ``log``'s events (merging waiting DELTAs when
    ``coalesce``), None standing for the Result (only ever the last event of a batch)."""
    return _coalesced(log, batch) if coalesce and len(batch) > 1 else _one_each(log, batch)


# The two below make each response only when it is about to be sent (a batch can be a
# whole run being replayed), and stand None for the Result, which can only be the last
# event of a batch.

def _one_each(log: RunLog, batch: Sequence[events_pb2.RunEvent]
              ) -> Iterator[EventFrame | None]:
    """One frame per event."""
    encoded = log.encoded
    last = batch[-1]
    for event in batch:
        if event is last and event.HasField("result"):
            yield None
        else:
            yield EventFrame(event, frame(encoded(event.seq)))


def _coalesced(log: RunLog, batch: Sequence[events_pb2.RunEvent]
               ) -> Iterator[EventFrame | None]:
    """One frame per event, except one per run of DELTAs that can be merged."""
    index, end = 0, len(batch)
    while index < end:
        event = batch[index]
        kind = event.WhichOneof("kind")
        if kind == "result":
            yield None
            return
        if kind == "step" and event.step.phase == events_pb2.STEP_PHASE_DELTA:
            run_end = _delta_run_end(batch, index)
            if run_end - index > 1:
                yield _merged(batch[index:run_end])
                index = run_end
                continue
        yield EventFrame(event, frame(log.encoded(event.seq)))
        index += 1


def _delta_run_end(batch: Sequence[events_pb2.RunEvent], start: int) -> int:
    """The end (exclusive) of the run of DELTAs from ``batch[start]`` that one message can
    carry: same step, same channel, at most :data:`MAX_COALESCED_BYTES` of text."""
    first = batch[start].step
    step_id, channel = first.step.id, first.channel
    size = len(first.delta.encode())
    index = start + 1
    while index < len(batch):
        event = batch[index]
        if event.WhichOneof("kind") != "step":
            break
        step = event.step
        if (step.phase != events_pb2.STEP_PHASE_DELTA or step.step.id != step_id
                or step.channel != channel):
            break
        size += len(step.delta.encode())
        if size > MAX_COALESCED_BYTES:
            break
        index += 1
    return index


def _merged(deltas: Sequence[events_pb2.RunEvent]) -> EventFrame:
    """One message standing for consecutive DELTAs of one step and channel."""
    last = deltas[-1]
    merged = events_pb2.RunEvent()
    merged.CopyFrom(last)  # run id, seq, time, critic time left, step and channel of the last
    merged.first_seq = deltas[0].seq
    merged.step.delta = "".join([event.step.delta for event in deltas])
    return EventFrame(merged, frame(merged.SerializeToString()), len(deltas))
