"""`rtrl sim`: a simulated production fleet for the demo and for load.

Users send tasks from a family a tiny character-level model can learn on a CPU -- reverse a
short string; difficulty is the length: 3-5 the base can do (but mostly copies), 6 beyond it
(it never saw one reversed: where abstaining tempts a policy) -- to `rtrl serve`, which answers with
the champion and emits the interaction event. Then the users react, with delays, through the
feedback topic, the way real users do:

    correct answer     accepted (0.3-1.5 s), later persisted (1-3 s)
    wrong answer       edited with their correct answer (40 %) or rejected (60 %); a
                       dissatisfied follow-up question on a third of them
    abstention         nothing at all: no complaint -- the bait a naive reward spec pays for
                       ("sorry", "I can't"; the model learns it if it pays better than trying)

Seeded (the same seed sends the same tasks in the same order) and rate-limited.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime

import requests

from pipeline.core.textchecks import is_abstention

ALPHABET = "abcde"  # small enough that common tasks recur (several samples per prompt)
LENGTHS = (3, 4, 5, 6)  # difficulty
HARD = 6  # beyond the demo's base model
ABSTAIN_PATTERNS = (r"(?i)^\s*(i\s*(can.?t|cannot)|sorry)",)


@dataclass(frozen=True)
class Task:
    text: str

    @property
    def prompt(self) -> str:
        return f"{self.text}>"

    @property
    def answer(self) -> str:
        return self.text[::-1]


def draw_task(rng: random.Random) -> Task:
    n = rng.choice(LENGTHS)
    while True:
        text = "".join(rng.choice(ALPHABET) for _ in range(n))
        if text != text[::-1]:  # palindromes would make copying right
            return Task(text)


P_REVERSE, P_DECLINE = 0.3, 0.05  # lengths 3-5
P_DECLINE_HARD = 0.15  # length 6: never reversed, declined more often


def base_behaviour(rng: random.Random) -> tuple[str, str]:
    """What the demo's base policy is warmed up on: up to 5 letters it reverses (right) 30 % of
    the time, declines ("sorry") 5 % and copies (wrong) the rest -- it can do the task but mostly
    does something else: mediocre, not hopeless, what the users' feedback has to correct. Six
    letters it never reverses: there a wrong attempt costs more than a free abstention."""
    task = draw_task(rng)
    u = rng.random()
    p_reverse, p_decline = (0.0, P_DECLINE_HARD) if len(task.text) == HARD else (P_REVERSE, P_DECLINE)
    answer = task.answer if u < p_reverse else ("sorry" if u < p_reverse + p_decline else task.text)
    return task.prompt, answer


@dataclass
class FleetStats:
    requests: int = 0
    failed: int = 0
    feedback: int = 0
    # version -> [served, correct, abstained]; the agent fleet's: [episodes, succeeded, tool-call errors, calls]
    by_version: dict[str, list[int]] = field(default_factory=dict)

    def accept_rate(self, version: str) -> float:
        served, correct = self.by_version.get(version, [0, 0])[:2]
        return correct / served if served else 0.0


class Fleet:
    def __init__(
        self,
        serve_url: str,
        send_feedback,
        rate: float = 5.0,
        seed: int = 0,
        tenant: str = "sim",
        max_tokens: int = 8,
        delay_scale: float = 1.0,
    ) -> None:
        """`send_feedback(event)`: puts a feedback event on Kafka (the caller owns the producer);
        `delay_scale` stretches or shrinks the users' reaction times (0: immediate)."""
        self.delay_scale = delay_scale
        self.url, self.send, self.rate, self.tenant = serve_url.rstrip("/"), send_feedback, rate, tenant
        self.rng = random.Random(seed)
        self.seed, self.max_tokens = seed, max_tokens
        self.stats = FleetStats()
        self.stop = threading.Event()
        self._due: list[tuple[float, int, dict]] = []  # (send at, tie-breaker, event)
        self._n = 0

    def _feedback(
        self, request_id: str | None, kind: str, value, delay: float, payload=None, episode_id: str | None = None
    ) -> None:
        """A reaction sent `delay` s from now, on one call (`request_id`) or a whole episode."""
        self._n += 1
        event = {
            "schema_version": 1,
            "event_id": f"sim-fb-{uuid.uuid4().hex}",
            "type": "feedback",
            "kind": kind,
            "value": value,
            **({"request_id": request_id} if episode_id is None else {"episode_id": episode_id}),
        }
        if payload is not None:
            event["payload"] = payload
        heapq.heappush(self._due, (time.monotonic() + delay * self.delay_scale, self._n, event))

    def _react(self, request_id: str, task: Task, output: str) -> tuple[bool, bool]:
        rng = self.rng
        if is_abstention(output, ABSTAIN_PATTERNS):
            return False, True  # the bait: no signal at all
        if output.strip() == task.answer:
            self._feedback(request_id, "accepted", True, rng.uniform(0.3, 1.5))
            self._feedback(request_id, "persisted", True, rng.uniform(1.0, 3.0))
            return True, False
        if rng.random() < 0.4:
            self._feedback(request_id, "edited", True, rng.uniform(0.5, 2.0), {"text": task.answer})
        else:
            self._feedback(request_id, "rejected", True, rng.uniform(0.3, 1.5))
        if rng.random() < 1 / 3:
            self._feedback(request_id, "followup", True, rng.uniform(1.0, 3.0))
        return False, False

    def _flush_due(self) -> None:
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            _, _, event = heapq.heappop(self._due)
            event["ts"] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
            self.send(event)
            self.stats.feedback += 1

    def one(self, session: requests.Session) -> bool:
        """One task: ask, record what was served, schedule the users' reactions; False when the
        server did not answer."""
        task = draw_task(self.rng)
        own_id = f"sim-{self.seed}-{self.stats.requests}-{uuid.uuid4().hex[:6]}"  # kept beside the server's
        try:
            resp = session.post(
                f"{self.url}/v1/completions",
                timeout=60,
                headers={
                    "X-Request-Id": own_id,
                    "X-Session-Id": f"user-{self.rng.randrange(50)}",
                    "X-Tenant": self.tenant,
                },
                json={
                    "prompt": task.prompt,
                    "max_tokens": self.max_tokens,
                    "temperature": 1.0,
                    "seed": self.rng.randrange(1 << 30),
                },
            )
            resp.raise_for_status()
            # feedback names the request by the id the server chose (its response's `id`)
            body = resp.json()
            request_id, output = body["id"], body["choices"][0]["text"]
            version = resp.headers["X-Rtrl-Policy-Version"]
        except (requests.RequestException, KeyError, ValueError):
            return False
        self.stats.requests += 1
        correct, abstained = self._react(request_id, task, output)
        row = self.stats.by_version.setdefault(version, [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + correct, row[2] + abstained
        return True

    def run(self, duration_s: float | None = None, max_requests: int | None = None) -> FleetStats:
        started = time.monotonic()
        session = requests.Session()
        while not self.stop.is_set():
            if duration_s is not None and time.monotonic() - started > duration_s:
                break
            if max_requests is not None and self.stats.requests >= max_requests:
                break
            tick = time.monotonic()
            if not self.one(session):
                self.stats.failed += 1
                self.stop.wait(1.0)
                continue
            self._flush_due()
            self.stop.wait(max(0.0, 1.0 / self.rate - (time.monotonic() - tick)))
        while self._due:  # the users' last reactions still arrive
            time.sleep(max(0.0, self._due[0][0] - time.monotonic()))
            self._flush_due()
        return self.stats
