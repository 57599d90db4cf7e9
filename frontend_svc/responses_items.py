"""A response's output items: a `reasoning` item (with `--reasoning-parser`), the assistant
`message`, and one `function_call` item per tool call, whole (`whole_items`) or opened, fed
and closed as the text streams (`ItemStream`), with the Responses API's events for each.

The text is split as the chat route splits it (reasoning.py, then the tool plan's parser), so
a response holds what the chat answer to the same input holds. A response always has its
message item, empty when the model only called tools, as the chat answer has its content.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from frontend_svc.reasoning import ReasoningParser, ReasoningStream
from frontend_svc.tool_calling.protocol import ToolPlan
from frontend_svc.tool_calling.stream import ToolCallStream, extract

Event = Callable[..., str]  # (type, **fields) -> one server-sent event


def reasoning_item(rid: str, text: str, done: bool) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if done else []
    status = "completed" if done else "in_progress"
    return {"id": rid, "type": "reasoning", "summary": [], "content": content, "status": status}


def call_item(fid: str, call_id: str, name: str, arguments: str, done: bool) -> dict[str, Any]:
    return {
        "id": fid,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed" if done else "in_progress",
    }


def whole_items(
    text: str,
    base: str,
    message: Callable[[str], dict[str, Any]],
    reasoning: ReasoningParser | None,
    plan: ToolPlan | None,
    call_ids: list[str] | None = None,
) -> list[dict[str, Any]]:
    """The items of a finished response's text; `message(text)` makes the message item.
    `call_ids`: the ids a stream gave its calls (so the final response repeats them)."""
    items = []
    if reasoning is not None:
        thought, text = reasoning.split(text)
        if thought:
            items.append(reasoning_item(f"rs_{base}", thought, True))
    calls = []
    if plan is not None and plan.parser is not None:
        found = extract(plan.parser, text, plan.max_calls)
        text, calls = found.content or "", found.tool_calls
    items.append(message(text))
    for k, c in enumerate(calls):
        cid = call_ids[k] if call_ids is not None and k < len(call_ids) else c["id"]
        f = c["function"]
        items.append(call_item(f"fc_{base}_{k}", cid, f["name"], f["arguments"], True))
    return items


class ItemStream:
    """The items of one streamed response as events: each opened when its first text arrives,
    closed when another begins or the response ends."""

    def __init__(
        self,
        base: str,
        event: Event,
        message: Callable[[str, bool], dict[str, Any]],
        reasoning: ReasoningParser | None,
        plan: ToolPlan | None,
    ) -> None:
        self.base, self.event, self.message = base, event, message
        self.thinker = ReasoningStream(reasoning) if reasoning else None
        parser = plan.parser if plan is not None else None
        self.reader = ToolCallStream(parser, plan.max_calls) if parser and plan else None
        self.items: list[dict[str, Any]] = []  # as streamed so far
        self.open: str | None = None  # the kind of the last item, while it is open
        self.text = {"reasoning": "", "message": ""}
        self.had_message = False

    @property
    def call_ids(self) -> list[str]:
        return list(self.reader.ids) if self.reader is not None else []

    def _at(self, content: bool = True) -> dict[str, Any]:
        at: dict[str, Any] = {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}
        return {**at, "content_index": 0} if content else at

    def _open(self, kind: str, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.items.append(item)
        self.open = kind
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                              item=item))  # fmt: skip
        if kind == "message":
            self.had_message = True
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(self.event("response.content_part.added", **self._at(), part=part))
        return out

    def close(self) -> list[str]:
        """The events that close the open item, if any."""
        kind, self.open = self.open, None
        if kind is None:
            return []
        item = self.items[-1]
        if kind == "reasoning":
            text = self.text["reasoning"]
            self.items[-1] = done = reasoning_item(item["id"], text, True)
            return [
                self.event("response.reasoning_text.done", **self._at(), text=text),
                self.event("response.output_item.done", output_index=len(self.items) - 1,
                           item=done),
            ]  # fmt: skip
        if kind == "message":
            text = self.text["message"]
            self.items[-1] = done = self.message(text, True)
            part = done["content"][0]
            return [
                self.event("response.output_text.done", **self._at(), text=text, logprobs=[]),
                self.event("response.content_part.done", **self._at(), part=part),
                self.event("response.output_item.done", output_index=len(self.items) - 1,
                           item=done),
            ]  # fmt: skip
        item["status"] = "completed"
        return [
            self.event("response.function_call_arguments.done", **self._at(False),
                       arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=len(self.items) - 1, item=item),
        ]  # fmt: skip

    def feed(self, text: str, finished: bool) -> list[str]:
        """The events of one delta's text."""
        out: list[str] = []
        thought = ""
        if self.thinker is not None:
            thought, text = self.thinker.feed(text)
            if finished:
                more = self.thinker.finish()
                thought, text = thought + more[0], text + more[1]
        if thought:
            if self.open != "reasoning":
                out += self._open("reasoning", reasoning_item(f"rs_{self.base}", "", False))
            self.text["reasoning"] += thought
            out.append(self.event("response.reasoning_text.delta", **self._at(), delta=thought))
        calls: list[dict[str, Any]] = []
        if self.reader is not None:
            text, calls = self.reader.feed(text)
            if finished:
                more_text, more_calls = self.reader.finish()
                text, calls = text + more_text, calls + more_calls
        if text:
            if self.open != "message":
                out += self._open("message", self.message("", False))
            self.text["message"] += text
            out.append(self.event("response.output_text.delta", **self._at(), delta=text,
                                  logprobs=[]))  # fmt: skip
        return out + self._calls(calls)

    def _calls(self, calls: list[dict[str, Any]]) -> list[str]:
        out = []
        for c in calls:
            if "id" in c:
                if not self.had_message:  # a response always holds its message, first
                    out += self._open("message", self.message("", False))
                k = c["index"]
                item = call_item(f"fc_{self.base}_{k}", c["id"], c["function"]["name"], "", False)
                out += self._open("call", item)
            elif args := c["function"].get("arguments"):
                self.items[-1]["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta", **self._at(False),
                                      delta=args))  # fmt: skip
        return out

    def end(self) -> list[str]:
        """The events that close the response's items (an empty message if none was sent)."""
        out = [] if self.had_message else self._open("message", self.message("", False))
        return out + self.close()
