"""The Responses event stream of one generation served by the chat path: OpenAI's events,
in OpenAI's order, numbered, as server-sent events the official SDK's stream reads."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import msgspec

from gateway.response_shapes import call_item, failed, finished, item_id
from tokenmill.errors import APIError
from tokenmill.openai_responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    LifecycleEvent,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
)
from tokenmill.openai_types import ToolCall, Usage
from tokenmill.structured import may_be_tool_call, parse_tool_calls

Store = Callable[[ResponseObject], Awaitable[None]]
Chunk = tuple[str, bool, bool, Usage]  # text, finished, truncated, usage so far


class Events:
    """Numbers events in order and writes them as server-sent events."""

    def __init__(self) -> None:
        self.sequence = 0

    def sse(self, event: msgspec.Struct) -> bytes:
        event.sequence_number = self.sequence  # type: ignore[attr-defined]
        self.sequence += 1
        kind: str = event.type  # type: ignore[attr-defined]
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


async def response_events(
    base: ResponseObject, chunks: AsyncGenerator[Chunk, None], tools: bool, store: Store
) -> AsyncIterator[bytes]:
    """The Responses event stream of one generation, OpenAI's order: created, in_progress,
    then per output item added, its content (text deltas, or a call's arguments) and done,
    then completed (or incomplete / failed). `store` runs with the final object before the
    last event, so a client that has read it can fetch the response at once. Closes `chunks`.

    With `tools`, text that is (or may still become) a tool call is held back, as for chat
    completions; calls go out whole, each as a function_call item."""
    ev = Events()
    yield ev.sse(LifecycleEvent("response.created", 0, base))
    yield ev.sse(LifecycleEvent("response.in_progress", 0, base))
    held: str | None = "" if tools else None  # None once the answer is known to be text
    text_item = _TextItem(ev)
    output: list[OutputItem] = []
    calls: list[ToolCall] | None = None
    truncated, usage = False, Usage(0, 0, 0)
    try:
        async for chunk in chunks:
            text, done, truncated, usage = chunk  # the last one's finish and usage are the answer's
            if held is not None:
                held += text
                calls = parse_tool_calls(held) if done else None
                if calls or (not done and may_be_tool_call(held)):
                    continue
                text, held = held, None
            for event in text_item.delta(text):
                yield event
        if calls:
            for call in calls:
                for event in _call_events(call, len(output), output):
                    yield ev.sse(event)
        else:
            for event in text_item.delta(held or ""):  # a call cut short is answered as text
                yield event
            for event in text_item.done(truncated, output):
                yield event
        final = finished(base, output, usage, truncated)
        await store(final)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield ev.sse(LifecycleEvent(kind, 0, final))
    except APIError as exc:  # the status line is long gone: report in-band, as OpenAI does
        yield ev.sse(ErrorEvent("error", 0, exc.code, exc.message, exc.param))
        yield ev.sse(LifecycleEvent("response.failed", 0, failed(base, output, exc)))
    finally:
        await chunks.aclose()


class _TextItem:
    """The events of the one message item a text answer streams as (output index 0)."""

    def __init__(self, ev: Events) -> None:
        self.ev = ev
        self.id = item_id("msg")
        self.parts: list[str] = []
        self.started = False

    def _start(self) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        item, empty = OutputMessage(id=self.id, status="in_progress", content=[]), OutputText(text="")
        return [
            self.ev.sse(OutputItemEvent("response.output_item.added", 0, 0, item)),
            self.ev.sse(ContentPartEvent("response.content_part.added", 0, self.id, 0, 0, empty)),
        ]

    def delta(self, text: str) -> list[bytes]:
        if not text:  # e.g. a token held back as a possible stop string
            return []
        self.parts.append(text)
        event = TextDeltaEvent("response.output_text.delta", 0, self.id, 0, 0, text)
        return [*self._start(), self.ev.sse(event)]

    def done(self, truncated: bool, output: list[OutputItem]) -> list[bytes]:
        text = "".join(self.parts)
        part = OutputText(text=text)
        item = OutputMessage(id=self.id, status="incomplete" if truncated else "completed", content=[part])
        output.append(item)
        return [
            *self._start(),
            self.ev.sse(TextDoneEvent("response.output_text.done", 0, self.id, 0, 0, text)),
            self.ev.sse(ContentPartEvent("response.content_part.done", 0, self.id, 0, 0, part)),
            self.ev.sse(OutputItemEvent("response.output_item.done", 0, 0, item)),
        ]


def _call_events(call: ToolCall, index: int, output: list[OutputItem]) -> list[msgspec.Struct]:
    """One whole call as a function_call item: added, its arguments in one delta, done."""
    started = call_item(call, "in_progress")
    started.arguments = ""
    done = call_item(call, "completed")
    done.id = started.id
    output.append(done)
    args = call.function.arguments
    return [
        OutputItemEvent("response.output_item.added", 0, index, started),
        ArgumentsDeltaEvent("response.function_call_arguments.delta", 0, started.id, index, args),
        ArgumentsDoneEvent("response.function_call_arguments.done", 0, started.id, index, args),
        OutputItemEvent("response.output_item.done", 0, index, done),
    ]
