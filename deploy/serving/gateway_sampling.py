"""What sampled the tokens the gateway records, and whether their log-probs are that distribution's.

Training and the gate recompute a served token's log-prob under the policy at the *recorded*
sampling settings -- temperature, then top-k, then top-p (train/sampling.py) -- and divide by the
logged one. That ratio is right only if (a) the upstream sampled at exactly the recorded settings
and (b) the log-probs it returned are those of the distribution it drew from.

(a) A server applies defaults of its own to what a request leaves out (vLLM: the model's
    generation_config.json, e.g. a temperature of 0.7 or a repetition penalty of 1.05), so the
    gateway sends every setting explicitly (`upstream_sampling`): the client's value, else the
    neutral one, and records what it sent.
(b) vLLM returns *raw* log-probs by default -- before temperature, penalties, top-k and top-p
    (vllm/v1/sample/sampler.py; `--logprobs-mode`, default raw_logprobs). Only with
    `--logprobs-mode processed_logprobs` are they the sampled distribution's. The gateway probes
    the upstream (`classify_probe`) and, unless it returns processed log-probs, keeps the logged
    log-probs only where raw and processed coincide: temperature 1 (or greedy), no top-k, no
    top-p, nothing else applied.

Settings training cannot recompute (penalties, min_p, a logit bias, grammars: a structured
output or a forced tool call) also change the distribution drawn from: an answer sampled under
them keeps its text and tokens but not its log-probs (training recomputes them from the
champion; the gate leaves it out), and the event's metadata says why.
"""

from __future__ import annotations

from typing import Any, Literal

LogprobsMode = Literal["processed", "raw", "unknown"]
LOGPROBS_FLAG = "--logprobs-mode processed_logprobs"

# the settings training recomputes, and their neutral values (top_k: vLLM's "off" is 0, or -1)
RECOMPUTED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
# sent as neutral unless the client set them; when set otherwise, not recomputable
NEUTRAL = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
GRAMMARS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def upstream_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """Every sampling setting the distribution depends on, explicitly: the client's, else neutral."""
    return {**RECOMPUTED, **NEUTRAL, **{k: body[k] for k in (*RECOMPUTED, *NEUTRAL) if body.get(k) is not None}}


def not_recomputable(body: dict[str, Any]) -> str | None:
    """Why training cannot recompute the distribution `body` samples from (None: it can)."""
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if value is not None and value != neutral:
            return f"{key}={value!r} changes the distribution; training recomputes only temperature, top_k, top_p"
    for key in ("logit_bias", "allowed_token_ids", "bad_words", "min_tokens", "thinking_token_budget"):
        if body.get(key):
            return f"{key} changes the distribution (vLLM applies it among the logits' processors)"
    if body.get("use_beam_search"):
        return "use_beam_search: the tokens were searched, not sampled"
    for key in GRAMMARS:
        value = body.get(key)
        if value and not (key == "response_format" and isinstance(value, dict) and value.get("type") == "text"):
            return f"{key} constrains the tokens (a grammar)"
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "a forced tool_choice constrains the tokens (a grammar)"
    tools = body.get("tools") or ()
    if (
        tools
        and choice != "none"
        and (
            body.get("parallel_tool_calls") is False
            or any(
                isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("strict")
                for t in tools
            )
        )
    ):
        return "strict tools or parallel_tool_calls=false constrain the tokens (vLLM's structural tag)"
    return None


def raw_equals_processed(sent: dict[str, Any]) -> bool:
    """Raw log-probs are the sampled distribution's: temperature 1 or greedy, no cut-off."""
    top_k = sent.get("top_k")
    return sent.get("temperature") in (0, 1) and sent.get("top_p") == 1 and (top_k is None or top_k <= 0)


def logprobs_kept(mode: LogprobsMode, body: dict[str, Any], sent: dict[str, Any]) -> str | None:
    """Why the answer's log-probs are not kept (None: kept)."""
    reason = not_recomputable(body)
    if reason is not None:
        return reason
    if mode != "processed" and not raw_equals_processed(sent):
        seen = "returns raw log-probs" if mode == "raw" else "was not seen to return processed log-probs"
        return f"the upstream {seen} (vLLM: start it with {LOGPROBS_FLAG})"
    return None


# The probe: a completion of one token of each prompt at three temperatures, same seed. At
# temperature t the processed log-prob of a token is log_softmax(logits / t)[token]: the argmax
# token's is nearer 0 at 0.01 than at 0.02, and ~0 at both when the top logits are apart -- then
# at 1.0 the same token's is clearly below 0 unless the model is certain. A raw one is
# log_softmax(logits)[token] whatever the temperature (up to the server's float noise).
PROBE_PROMPTS = ("The", "Once upon a time", "1, 2, 3,")
PROBE_TEMPERATURES = (0.01, 0.02, 1.0)
Sample = tuple[object, float]  # (the token, its log-prob)


def classify_probe(prompts: list[list[Sample]]) -> LogprobsMode:
    """From each probe prompt's (token, log-prob) at PROBE_TEMPERATURES."""
    verdicts = [v for v in (_verdict(*samples) for samples in prompts) if v is not None]
    if "raw" in verdicts:
        return "raw"
    return "processed" if verdicts else "unknown"


def _verdict(cold: Sample, cool: Sample, warm: Sample) -> LogprobsMode | None:
    """Raw log-probs give a token the same value at every temperature; processed ones move with
    it. A tie at the top moves neither at 0.01 and 0.02 (each of the two keeps half), so "raw"
    needs the same value at 1.0 too; a certain model says nothing."""
    (token, a), (token_b, b), (token_c, c) = cold, cool, warm
    if max(a, b, c) > 1e-6:
        return "raw"  # logits, not log-probs (vLLM's raw_logits / processed_logits)
    if token != token_b:
        return None
    if not same(a, b):
        return "processed"  # the same token at two temperatures, two values
    if token_c != token or (a > -1e-5 and c > -1e-5):
        return None  # nothing to compare with, or a model certain of this token
    if a > -1e-5:
        return "processed"  # ~0 when cold, clearly below 0 at 1.0
    return "raw" if same(a, c) else None  # a == b != c: a tie at the top


def same(x: float, y: float) -> bool:
    """Equal up to a server's float noise (batches of other sizes round otherwise)."""
    return abs(x - y) <= 1e-3 * max(abs(x), abs(y)) + 1e-6
