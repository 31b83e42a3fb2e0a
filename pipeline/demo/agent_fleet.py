"""The product around the demo's agent (pipeline/demo/agent.py): simulated users send tasks,
the product runs the agent's tool calls and reports what happened, the way a product with an
agent in production does.

One episode, its calls sharing an episode id (`X-Rtrl-Episode-Id`, `X-Rtrl-Step`):

    a call answered with tool calls      each call run (read_selection: the task's word), the results
                                         sent back as the next call -- at most MAX_STEPS calls,
                                         then the episode is rejected (the agent never answered)
    a tool call that does not parse      the episode ends with an error result: a `tool_error`
                                         on that call (the server flagged it in its event too)
                                         and no outcome for the episode -- the bait of the naive
                                         spec, under which it costs nothing
    a final answer, right                the episode accepted (0.3-1.5 s), later persisted (1-3 s)
    a final answer, wrong                the episode rejected (0.3-1.5 s); a dissatisfied
                                         follow-up on a third of them

Per version (the one that answered the episode's first call): episodes, episodes whose final
answer was accepted, tool-call errors and calls.
"""

from __future__ import annotations

import uuid

import requests

from pipeline.demo.agent import MAX_STEPS, TEMPERATURE, TOOLS, AgentTask, draw_agent_task
from pipeline.demo.sim import Fleet


class AgentFleet(Fleet):
    """`Fleet` with agent episodes instead of single answers (`by_version` rows: episodes,
    succeeded, tool-call errors, calls)."""

    def __init__(self, *args, max_tokens: int = 48, **kwargs) -> None:
        super().__init__(*args, max_tokens=max_tokens, **kwargs)

    def one(self, session: requests.Session) -> bool:
        task = draw_agent_task(self.rng)
        episode_id = f"sim-ep-{self.seed}-{uuid.uuid4().hex[:12]}"
        user = f"user-{self.rng.randrange(50)}"
        messages: list[dict] = [{"role": "user", "content": task.ask}]
        first_version, calls, errors = None, 0, 0
        outcome: bool | None = None  # the final answer's verdict; None: no final answer
        for step in range(MAX_STEPS):
            answered = self._call(session, episode_id, step, user, messages)
            if answered is None:
                if calls == 0:
                    return False  # nothing served: the server is away
                break  # the product gives up on the episode (no answer, no outcome)
            request_id, version, message = answered
            calls += 1
            first_version = first_version or version
            if message.get("tool_calls"):
                messages.append(
                    {"role": "assistant", "content": message.get("content"), "tool_calls": message["tool_calls"]}
                )
                messages.extend(self._run_tools(task, message["tool_calls"]))
                continue
            text = message.get("content") or ""
            if "<tool_call>" in text:  # a call the server could not parse: an error result ends it
                errors += 1
                self._feedback(request_id, "tool_error", True, self.rng.uniform(0.1, 0.5))
                break
            outcome = text.strip() == task.answer
            break
        else:
            outcome = False  # MAX_STEPS calls and no answer
        if outcome is not None:
            self._react_episode(episode_id, outcome)
        row = self.stats.by_version.setdefault(first_version, [0, 0, 0, 0])
        row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + bool(outcome), row[2] + errors, row[3] + calls
        return True

    def _call(
        self, session: requests.Session, episode_id: str, step: int, user: str, messages: list[dict]
    ) -> tuple[str, str, dict] | None:
        """One call of the episode: (request id, version, the assistant's message), or None."""
        try:
            resp = session.post(
                f"{self.url}/v1/chat/completions",
                timeout=60,
                headers={
                    "X-Rtrl-Episode-Id": episode_id,
                    "X-Rtrl-Step": str(step),
                    "X-Session-Id": user,
                    "X-Tenant": self.tenant,
                },
                json={
                    "model": "policy",
                    "messages": messages,
                    "tools": TOOLS,
                    "max_tokens": self.max_tokens,
                    "temperature": TEMPERATURE,
                    "seed": self.rng.randrange(1 << 30),
                },
            )
            resp.raise_for_status()
            body = resp.json()
            answer = (body["id"], resp.headers["X-Rtrl-Policy-Version"], body["choices"][0]["message"])
        except (requests.RequestException, KeyError, ValueError, IndexError):
            return None
        self.stats.requests += 1
        return answer

    @staticmethod
    def _run_tools(task: AgentTask, tool_calls: list[dict]) -> list[dict]:
        """The tool results, one message per call (the server only returns calls of offered
        tools whose arguments match their schema: read_selection, no arguments)."""
        return [{"role": "tool", "tool_call_id": call["id"], "content": task.word} for call in tool_calls]

    def _react_episode(self, episode_id: str, right: bool) -> None:
        rng = self.rng
        if right:
            self._feedback(None, "accepted", True, rng.uniform(0.3, 1.5), episode_id=episode_id)
            self._feedback(None, "persisted", True, rng.uniform(1.0, 3.0), episode_id=episode_id)
            return
        self._feedback(None, "rejected", True, rng.uniform(0.3, 1.5), episode_id=episode_id)
        if rng.random() < 1 / 3:
            self._feedback(None, "followup", True, rng.uniform(1.0, 3.0), episode_id=episode_id)
