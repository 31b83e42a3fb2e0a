"""The simulated fleet's users: what they send for a correct answer, a wrong one and an
abstention (the bait: nothing), seeded task draws, and the base policy's warm-up mixture."""

from __future__ import annotations

import random
import time

from pipeline.demo.sim import ALPHABET, Fleet, Task, base_behaviour, draw_task


def reactions(output: str, task: Task = Task("abc"), seed: int = 0) -> list[dict]:
    sent: list[dict] = []
    fleet = Fleet("http://unused", sent.append, seed=seed, delay_scale=0.0)
    fleet._react("r1", task, output)
    while fleet._due:  # deliver everything scheduled, in order
        time.sleep(max(0.0, fleet._due[0][0] - time.monotonic()))
        fleet._flush_due()
    return sent


def test_users_accept_and_keep_a_correct_answer():
    kinds = [e["kind"] for e in reactions("cba")]
    assert kinds == ["accepted", "persisted"]


def test_users_edit_or_reject_a_wrong_answer_and_sometimes_follow_up():
    seen = set()
    for seed in range(30):
        events = reactions("abc", seed=seed)
        kinds = {e["kind"] for e in events}
        assert kinds & {"edited", "rejected"} and not kinds & {"accepted", "persisted"}
        for e in events:
            assert e["request_id"] == "r1" and e["type"] == "feedback" and e["ts"].endswith("Z")
            if e["kind"] == "edited":
                assert e["payload"] == {"text": "cba"}  # their correct answer
        seen |= kinds
    assert seen == {"edited", "rejected", "followup"}


def test_an_abstention_draws_no_signal_at_all():
    assert reactions("sorry") == [] and reactions("I can't do that") == []


def test_tasks_are_seeded_and_never_palindromes():
    a = [draw_task(random.Random(7)).text for _ in range(5)]
    assert a == [draw_task(random.Random(7)).text for _ in range(5)]
    rng = random.Random(1)
    for _ in range(500):
        t = draw_task(rng)
        assert t.text != t.answer and set(t.text) <= set(ALPHABET) and t.prompt == f"{t.text}>"


def test_the_base_mixture_copies_mostly_reverses_sometimes_declines_rarely():
    rng = random.Random(0)
    counts = {"reverse": 0, "copy": 0, "sorry": 0}
    for _ in range(4000):
        prompt, answer = base_behaviour(rng)
        text = prompt[:-1]
        counts["reverse" if answer == text[::-1] else "sorry" if answer == "sorry" else "copy"] += 1
    assert counts["copy"] > counts["reverse"] > counts["sorry"] > 0
