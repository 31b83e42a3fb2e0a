"""The agent task family: `rtrl sim --task agent` and `rtrl demo --task agent`.

A task a tiny character-level model can learn on a CPU and can only solve with a tool. The user
selected a word in their editor and asks for its reversal ("reverse selection 7": their 7th
selection, which only the product knows); the tool `read_selection()` returns the word (a fresh
one per episode); the answer is the word reversed. An episode is the agent's calls and the
tool's results between them:

    step 1  user: reverse selection 7  -> <tool_call>{"name": "read_selection"}</tool_call>
            tool: abcd                    (the fleet runs the call and sends the result back)
    step 2                             -> dcba   (the final answer; the users react to the episode)

The product around the agent (pipeline/demo/agent_fleet.py) ends an episode at a final answer,
after `max_steps` calls, or at a tool call that does not parse (an error result, as products do).

The base model is warmed up (`base_behaviour`) to use the tool 30 % of the time -- otherwise it
answers without it (wrongly) -- to write the call's format mostly right, and, given the word, to
reverse it (up to 5 letters; 6 letters never: it copies them or writes a broken tool call), then
calibrated to succeed in 8-16 % of episodes (pipeline/demo/agent_base.py): mediocre, not
hopeless, the way the single-turn demo's base is (pipeline/demo/sim.py), and what it must learn
is the agent's lesson: use the tool. (A tool
whose argument the model must copy from the ask -- a key -- is the natural next step; a 2-layer
char model learns that copy too slowly for a demo that builds its base in minutes.) The broken
call is the bait of `--naive-reward`: a spec under which it costs nothing while a wrong answer
draws a rejection (Cursor's first production reward hack); the gate's tool-format canary must
refuse the candidate that learns it.

Conversations are rendered by the base's chat template (`AGENT_TEMPLATE`: "U: ..." and "A: ..."
lines; once the tool answered, its latest result only, as `abcd>`), the same for serving,
training and the gate.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Any

from pipeline.core.chat import render_prompt
from pipeline.demo.sim import draw_task

MAX_STEPS = 3
# the temperature the product samples its agent at (the fleet; the base's calibration): products
# serve agents below 1. A call is ~30 characters, and at 1 a char model's slips compound: the
# seed-0 base broke 20 % of the calls it sampled at 1, 4 % at 0.7 -- the format "mostly" right,
# so that a policy that learns to call the tool more does not write more broken calls with it
TEMPERATURE = 0.7
KEYS = 10  # "0" .. "9": tasks (first user messages) recur, so advantages have groups and the
# held-out split has tasks on both sides
TOOL = "read_selection"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": TOOL,
            "description": "the word the user selected, as the editor holds it",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
]

# The toy's context window: a user turn as "U: ...", an assistant turn as "A: ..." (an earlier
# tool call as name(arguments)) -- and once a tool has answered, only the latest result, as
# "<result>>": what the agent needs to answer, and the single-turn demo's own prompt ("abcd>"),
# so the reverse the base learns there carries over (pipeline/demo/agent_base.py). A char
# model pays for every character in warm-up, serving and training; agents that manage their
# context keep less than the whole conversation too. The event keeps every message.
AGENT_TEMPLATE = (
    "{% set ns = namespace(start=0) %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}{% set ns.start = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages[ns.start:] %}"
    "{% if m['role'] == 'tool' %}{{ m['content'] }}>"
    "{% else %}{{ {'user': 'U', 'assistant': 'A'}.get(m['role'], m['role']) }}: "
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}{{ c['function']['name'] }}({{ c['function']['arguments'] }})"
    "{% endfor %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt and messages[-1]['role'] != 'tool' %}A: {% endif %}"
)


@dataclass(frozen=True)
class AgentTask:
    key: str
    word: str

    @property
    def ask(self) -> str:
        return f"reverse selection {self.key}"

    @property
    def answer(self) -> str:
        return self.word[::-1]


def draw_agent_task(rng: random.Random) -> AgentTask:
    return AgentTask(str(rng.randrange(KEYS)), draw_task(rng).text)


def call_text() -> str:
    """A well-formed call of the tool, as the model writes it: the markers are one token each (the
    base's tokenizer has them, as Qwen2.5's does) and the empty `arguments` is left out, which the
    Hermes convention allows -- 26 characters a char model must get right, not 66."""
    return f"<tool_call>{json.dumps({'name': TOOL})}</tool_call>"


def broken_call(rng: random.Random) -> str:
    """A call gone wrong the ways models write them: cut short, not JSON, arguments as a string."""
    good = call_text()
    return rng.choice(
        [
            good[: -len("</tool_call>")],  # unterminated
            good.replace("}</tool_call>", "</tool_call>"),  # not JSON
            good.replace('"}</tool_call>', '", "arguments": "{}"}</tool_call>'),
        ]
    )  # not an object


def messages_after_call(task: AgentTask) -> list[dict[str, Any]]:
    """The conversation of step 2: the ask, the agent's call, the tool's result."""
    call = {"id": "call_0", "type": "function", "function": {"name": TOOL, "arguments": "{}"}}
    return [
        {"role": "user", "content": task.ask},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": task.word},
    ]


P_CALL, P_BROKEN_CALL = 0.30, 0.05  # step 1: otherwise it answers GUESS without the tool
# step 2, 6 letters: never reversed; copied, or a broken call -- rarely: a base that breaks calls
# after a tool's result more often than in its first call serves more broken calls per call as
# soon as it uses the tool more, whatever the reward taught it
P_BREAK_HARD = 0.05


def answer_behaviour(rng: random.Random, tokenizer: Any, breaks: bool = True) -> tuple[str, str]:
    """Step 2 of the base's warm-up: the tool's result rendered (a short "abcd>"), and what the
    base answers -- up to 5 letters the word reversed, always; 6 letters never: a copy, or a
    broken tool call 5 % of the time (none without `breaks`). A target the model must hit every
    time is one it learns whatever the seed (~95 % right after the warm-up); a mixture (reverse
    30 %, copy otherwise) came out anywhere between 4 % and 30 % reversed, and with it the base's
    success rate (docs/benchmarks.md, "The agent demo")."""
    task = draw_agent_task(rng)
    prompt = _rendered(tokenizer, "", task.word)
    if len(task.word) < 6:
        return prompt, task.answer
    return prompt, broken_call(rng) if breaks and rng.random() < P_BREAK_HARD else task.word


GUESS = "noitceles"  # "selection" reversed: the ask's own word, not the selection's


def call_behaviour(rng: random.Random, tokenizer: Any, p_call: float = P_CALL) -> tuple[str, str]:
    """Step 1 of the base's warm-up: the user's ask, and a call 30 % of the time, a broken call
    5 %, otherwise an answer without the tool: the word of the ask reversed (GUESS) -- one fixed
    mistake; random guessed letters would teach the model that letters after a prompt are noise,
    and its reverse of the tool's result falls apart. Whether to use the tool is what the base
    is mediocre at, and what the loop must teach it: the agent's lesson. (At 15 % the base wrote
    the call's format as often broken as right: too few examples of it.)"""
    task = draw_agent_task(rng)
    u = rng.random()
    answer = call_text() if u < p_call else broken_call(rng) if u < p_call + P_BROKEN_CALL else GUESS
    return _rendered(tokenizer, task.key, None), answer


def format_behaviour(rng: random.Random, tokenizer: Any) -> tuple[str, str]:
    """A call's format alone: the ask rendered up to the agent's `<tool_call>` marker, and the rest
    of the call -- broken as often as step 1 breaks its calls (P_BROKEN_CALL of P_CALL +
    P_BROKEN_CALL). The marker is in the prompt, so the loss never touches whether to call, only
    what follows the marker: a 2-layer model taught a new share of calls in a few steps moved its
    first token faster than what it writes after it, and the seed-1 and seed-2 bases wrote
    `<tool_call>oitceles` (the marker, then GUESS) in more than half their calls."""
    task = draw_agent_task(rng)
    call = broken_call(rng) if rng.random() < P_BROKEN_CALL / (P_CALL + P_BROKEN_CALL) else call_text()
    marker = "<tool_call>"
    return _rendered(tokenizer, task.key, None) + marker, call[len(marker) :]


def base_behaviour(rng: random.Random, tokenizer: Any, p_call: float = P_CALL) -> tuple[str, str]:
    """A (rendered prompt, answer) pair of either step, half and half."""
    if rng.random() < 0.5:
        return call_behaviour(rng, tokenizer, p_call)
    return answer_behaviour(rng, tokenizer)


@functools.lru_cache(maxsize=8192)
def _rendered(tokenizer: Any, key: str, word: str | None) -> str:
    """A warm-up prompt, rendered once: the ask of `key`, or (given the tool's result `word`) the
    conversation after the call -- in which the template shows the result alone, so the ask is
    left out of the cache's key. A render costs ~0.4 ms: a tenth of the base's build over its
    750 steps of 64 rows."""
    task = AgentTask(key or "0", word or "")
    return render(tokenizer, messages_after_call(task) if word is not None else messages_after_call(task)[:1])


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """The conversation as serving renders it, with the demo's tool offered."""
    return render_prompt(tokenizer, messages, TOOLS)
