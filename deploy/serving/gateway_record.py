"""What `rtrl gateway` records of an upstream's answer: one record per choice, whole.

An OpenAI-compatible server (vLLM at the tag named in tests/support/vllm_stub.py) answers a request
with `n` choices, each told apart by its `index`:

    unstreamed   choices[i].message {content, tool_calls[]} (chat) or .text, .logprobs, .finish_reason
    streamed     `data: <chunk>` lines, each chunk carrying some choices' deltas:
                   delta.content            a piece of the text
                   delta.tool_calls[]       fragments of tool calls: the first of a call has its
                                            `index`, `id`, `type` and `function.name`; those after it
                                            only the `index` and a piece of `function.arguments`
                   logprobs.content[]       the log-prob entries of the tokens of this delta
                 a chunk `{"error": {...}}` when generation failed mid-stream, then `data: [DONE]`

`ChoiceRecord` joins a choice's pieces -- text in order, a tool call's argument pieces by the
call's index -- so that the event holds the whole call the user got, not its first fragment
(whose empty arguments look well formed to the tool-format guard). `AnswerRecord` keeps one
record per choice index, never interleaving two choices, and remembers an error frame: an
answer cut by an error is kept, marked, and not trained on.

Each choice is its own request: the first keeps the answer's request id, the others get ids of
their own, and the siblings share a group id (one task sampled n times: advantages compare them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def token_id(entry: dict[str, Any]) -> int | None:
    """A log-prob entry's token id: vLLM's `"token_id:<id>"` token, or rtrl serve's `token_id`."""
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:"):
        tail = token.split(":", 1)[1]
        return int(tail) if tail.lstrip("-").isdigit() else None
    value = entry.get("token_id")
    return value if isinstance(value, int) else None


def completion_entries(logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
    """/v1/completions' column-wise log-probs (`tokens`, `token_logprobs`) as chat's entries."""
    lp = logprobs or {}
    return [{"token": t, "logprob": v} for t, v in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [])]


@dataclass
class ChoiceRecord:
    """One choice of an answer, its pieces joined."""

    index: int
    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # tool calls by their index
    entries: list[dict[str, Any]] = field(default_factory=list)  # log-prob entries, one per token
    ids: list[int] = field(default_factory=list)  # the sampled token ids (vLLM's `token_ids`)
    finish_reason: str | None = None

    @property
    def completion(self) -> str:
        return "".join(self.text)

    @property
    def token_ids(self) -> list[int] | None:
        """The sampled tokens' ids: the upstream's `token_ids`, else read from the log-prob entries
        (vLLM's "token_id:<id>" tokens, rtrl serve's `token_id`); None if not all are known."""
        if self.ids:
            return self.ids
        ids = [token_id(e) for e in self.entries]
        return ids if ids and None not in ids else None  # type: ignore[return-value]

    @property
    def tool_calls(self) -> list[dict[str, Any]] | None:
        return [self.calls[k] for k in sorted(self.calls)] or None

    def add_call_fragment(self, fragment: dict[str, Any]) -> None:
        """A streamed tool call's fragment: the first names the call, the rest extend its arguments."""
        k = fragment.get("index", 0)
        fn = fragment.get("function") or {}
        call = self.calls.get(k)
        if call is None:
            self.calls[k] = {
                "id": fragment.get("id"),
                "type": fragment.get("type") or "function",
                "function": {"name": fn.get("name") or "", "arguments": fn.get("arguments") or ""},
            }
            return
        if fragment.get("id") and not call["id"]:
            call["id"] = fragment["id"]
        if fn.get("name") and not call["function"]["name"]:
            call["function"]["name"] = fn["name"]
        call["function"]["arguments"] += fn.get("arguments") or ""

    def add_delta(self, choice: dict[str, Any], chat: bool) -> None:
        """One streamed chunk's piece of this choice."""
        if chat:
            delta = choice.get("delta") or {}
            self.text.append(delta.get("content") or "")
            for fragment in delta.get("tool_calls") or ():
                self.add_call_fragment(fragment)
            self.entries.extend((choice.get("logprobs") or {}).get("content") or [])
        else:
            self.text.append(choice.get("text") or "")
            self.entries.extend(completion_entries(choice.get("logprobs")))
        self.ids.extend(_ints(choice.get("token_ids")))
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    @classmethod
    def of_choice(cls, choice: dict[str, Any], chat: bool) -> ChoiceRecord:
        """A whole (unstreamed) choice."""
        record = cls(
            choice_index(choice), finish_reason=choice.get("finish_reason"), ids=_ints(choice.get("token_ids"))
        )
        if chat:
            message = choice.get("message") or {}
            record.text.append(message.get("content") or "")
            for k, call in enumerate(message.get("tool_calls") or ()):
                record.calls[k] = call
            record.entries = (choice.get("logprobs") or {}).get("content") or []
        else:
            record.text.append(choice.get("text") or "")
            record.entries = completion_entries(choice.get("logprobs"))
        return record


@dataclass
class AnswerRecord:
    """An answer's choices by index, with the request id each is known by."""

    request_id: str
    new_id: Callable[[], str]  # an id for each further choice (and the group)
    choices: dict[int, ChoiceRecord] = field(default_factory=dict)
    ids: dict[int, str] = field(default_factory=dict)
    group_id: str | None = None
    error: dict[str, Any] | None = None  # the upstream's error frame, if the stream ended on one

    def choice(self, index: int) -> ChoiceRecord:
        if index not in self.choices:
            self.choices[index] = ChoiceRecord(index)
            self.id_of(index)
        return self.choices[index]

    def id_of(self, index: int) -> str:
        """The request id of choice `index`: the answer's for the first, a new one for the others."""
        if index not in self.ids:
            self.ids[index] = self.request_id if index == 0 else self.new_id()
            if len(self.ids) > 1 and self.group_id is None:
                self.group_id = self.new_id()
        return self.ids[index]

    def add_chunk(self, chunk: dict[str, Any], chat: bool) -> None:
        """One streamed chunk (an error frame is remembered)."""
        if "error" in chunk and not chunk.get("choices"):
            error = chunk["error"]
            self.error = error if isinstance(error, dict) else {"message": str(error)}
            return
        for choice in chunk.get("choices") or ():
            self.choice(choice_index(choice)).add_delta(choice, chat)

    def add_whole(self, data: dict[str, Any], chat: bool) -> list[int]:
        """An unstreamed answer's choices; returns the index each was recorded under, in order."""
        order = []
        for position, choice in enumerate(data.get("choices") or ()):
            if not isinstance(choice, dict):
                continue
            record = ChoiceRecord.of_choice(choice, chat)
            if record.index in self.choices:  # no index, or one repeated: its place in the list
                record.index = position
            self.choices[record.index] = record
            self.id_of(record.index)
            order.append(record.index)
        return order

    def records(self) -> list[tuple[str, ChoiceRecord]]:
        """(request id, record) of every choice, in index order."""
        return [(self.ids[k], self.choices[k]) for k in sorted(self.choices)]


def choice_index(choice: dict[str, Any]) -> int:
    """A choice's index (0 when it has none: one choice)."""
    index = choice.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else 0


def _ints(value: Any) -> list[int]:
    """A `token_ids` field: its ids, or none when it is absent or not a list of ints."""
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return []
