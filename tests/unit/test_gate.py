"""The gate (a pure function) and the off-policy estimator behind it.

Property: for random limits and random reports, a candidate inside every limit is promoted, and
the same candidate with any one criterion broken is not -- and the decision names that criterion.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deploy.gate import Comparison, Estimate, EvalReport, decide
from deploy.offpolicy import compare
from pipeline.core.config import Bound, GateConfig

METRICS = ["abstention_rate", "mean_length", "tool_format_error_rate"]
finite = st.floats(min_value=-100, max_value=100, allow_nan=False)
limit = st.one_of(st.none(), st.floats(min_value=0.01, max_value=5))


@st.composite
def bounds(draw) -> Bound:
    lo, hi = draw(st.one_of(st.none(), finite)), draw(st.one_of(st.none(), finite))
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    return Bound(
        min=lo,
        max=hi,
        max_increase=draw(limit),
        max_decrease=draw(limit),
        max_rel_increase=draw(limit),
        max_rel_decrease=draw(limit),
    )


def allowed(b: Bound, champ: float) -> tuple[float, float]:
    """The interval of candidate values the bound lets through, given the champion's value."""
    lo = max(
        x
        for x in [
            -math.inf,
            b.min,
            b.max_decrease and champ - b.max_decrease,
            b.max_rel_decrease and champ and champ - b.max_rel_decrease * abs(champ),
        ]
        if x is not None
    )
    hi = min(
        x
        for x in [
            math.inf,
            b.max,
            b.max_increase and champ + b.max_increase,
            b.max_rel_increase and champ and champ + b.max_rel_increase * abs(champ),
        ]
        if x is not None
    )
    return lo, hi


@st.composite
def passing_case(draw):
    cfg = GateConfig(
        min_improvement=draw(st.floats(-0.1, 0.1)),
        min_ess=draw(st.floats(1, 100)),
        max_kl=draw(st.floats(0.01, 2)),
        bounds={m: draw(bounds()) for m in METRICS},
    )
    champ_metrics, cand_metrics = {}, {}
    for m, b in cfg.bounds.items():
        champ = draw(finite.filter(lambda x: x != 0))
        lo, hi = allowed(b, champ)
        lo, hi = max(lo, -1e3), min(hi, 1e3)
        assume(lo < hi - 1e-6)
        champ_metrics[m] = champ
        cand_metrics[m] = draw(st.floats(lo + (hi - lo) * 1e-3, hi - (hi - lo) * 1e-3))
    items = draw(st.dictionaries(st.sampled_from(list("abcdefgh")), st.booleans(), max_size=6))
    champion = EvalReport("1", Estimate(0.1, 0.0, 0.2), ess=200, metrics=champ_metrics, regression=items)
    # the candidate passes everything the champion passes (and maybe more)
    cand_items = {k: v or draw(st.booleans()) for k, v in items.items()}
    candidate = EvalReport(
        "candidate",
        Estimate(0.3, 0.2, 0.4),
        ess=cfg.min_ess + draw(st.floats(0, 100)),
        metrics=cand_metrics,
        regression=cand_items,
    )
    gain = cfg.min_improvement + draw(st.floats(1e-3, 1))
    comparison = Comparison(Estimate(gain + 0.1, gain, gain + 0.2), kl=cfg.max_kl * draw(st.floats(0, 1)))
    return cfg, candidate, champion, comparison


@settings(max_examples=300, deadline=None)
@given(passing_case(), st.sampled_from(["smoke", "ess", "improvement", "kl", "regression", "bound"]), st.data())
def test_the_gate_promotes_only_a_candidate_that_passes_every_criterion(case, broken, data):
    cfg, candidate, champion, comparison = case
    assert decide(candidate, champion, comparison, cfg).passed

    if broken == "smoke":
        candidate.smoke_ok, candidate.smoke_error = False, "OSError: adapter_model.safetensors is truncated"
    elif broken == "ess":
        candidate.ess = cfg.min_ess * data.draw(st.floats(0, 0.99))
    elif broken == "improvement":
        low = cfg.min_improvement - data.draw(st.floats(0, 1))
        comparison.improvement = Estimate(low + 0.1, low, low + 0.2)
    elif broken == "kl":
        comparison.kl = cfg.max_kl * data.draw(st.floats(1.01, 100))
    elif broken == "regression":
        assume(any(champion.regression.values()))
        item = data.draw(st.sampled_from([k for k, v in champion.regression.items() if v]))
        candidate.regression[item] = False
    else:
        m = data.draw(st.sampled_from(METRICS))
        lo, hi = allowed(cfg.bounds[m], champion.metrics[m])
        assume(math.isfinite(lo) or math.isfinite(hi))
        candidate.metrics[m] = (hi + 1 + abs(hi) * 0.01) if math.isfinite(hi) else (lo - 1 - abs(lo) * 0.01)
        broken = f"bound:{m}"
    decision = decide(candidate, champion, comparison, cfg)
    assert not decision.passed
    assert broken in {c.name for c in decision.checks if not c.passed}, decision.reasons


def test_first_deployment_uses_absolute_limits_or_refuses():
    cfg = GateConfig(bounds={"abstention_rate": Bound(max=0.2, max_increase=0.01)})
    metrics = {
        "abstention_rate": 0.1,
        "repetition_rate": 0.0,
        "tool_format_error_rate": 0.0,  # the default
        "tool_format_error_rate_after_result": 0.0,
        "mean_length": 40.0,
        "smoke_latency_ms": 12.0,
    }  # bounds
    cand = EvalReport("candidate", Estimate(0.3, 0.2, 0.4), ess=50, metrics=metrics, regression={"a": True})
    decision = decide(cand, None, None, cfg)
    assert decision.passed and decision.first_deployment
    assert {c.name for c in decision.checks if not c.applicable} >= {"improvement", "kl"}
    cand.metrics["abstention_rate"] = 0.25
    assert decide(cand, None, None, cfg).reasons == ["abstention_rate 0.25 (max 0.2)"]
    refused = decide(cand, None, None, cfg.model_copy(update={"first_deployment": "refuse"}))
    assert not refused.passed and any("promote by hand" in r for r in refused.reasons)


def test_first_deployment_against_the_base_model_must_beat_it():
    cfg = GateConfig()
    metrics = {
        "abstention_rate": 0.0,
        "repetition_rate": 0.0,
        "tool_format_error_rate": 0.0,
        "tool_format_error_rate_after_result": 0.0,
        "mean_length": 40.0,
        "smoke_latency_ms": 12.0,
    }
    cand = EvalReport("candidate", Estimate(0.3, 0.2, 0.4), ess=50, metrics=metrics)
    base = EvalReport("base", Estimate(0.35, 0.3, 0.4), ess=400, metrics=dict(metrics))
    worse = decide(cand, base, Comparison(Estimate(-0.05, -0.1, 0.0), kl=0.1), cfg, first=True)
    assert worse.first_deployment and not worse.passed
    assert any(r.startswith("reward improvement -0.0500") for r in worse.reasons)
    better = decide(cand, base, Comparison(Estimate(0.05, 0.01, 0.1), kl=0.1), cfg, first=True)
    assert better.first_deployment and better.passed, better.reasons
    # the base runs with no adapter: LoRA's own serving cost is not held against a first candidate
    slow = EvalReport("candidate", Estimate(0.3, 0.2, 0.4), ess=50, metrics={**metrics, "smoke_latency_ms": 60.0})
    first = decide(slow, base, Comparison(Estimate(0.05, 0.01, 0.1), kl=0.1), cfg, first=True)
    assert first.passed, first.reasons
    assert any(c.name == "bound:smoke_latency_ms" and not c.applicable for c in first.checks)
    # ... but against a champion that carries an adapter too, the same slowdown fails
    later = decide(slow, base, Comparison(Estimate(0.05, 0.01, 0.1), kl=0.1), cfg)
    assert not later.passed and any("smoke_latency_ms rel increase 4" in r for r in later.reasons), later.reasons


def test_off_policy_estimate_is_the_plain_mean_on_policy_and_moves_with_the_target():
    rng = np.random.default_rng(0)
    n = 4000
    mu = np.log(np.full(n, 0.5))  # the behaviour policy picked "good" or "bad" with probability 1/2
    good = rng.random(n) < 0.5
    rewards = good.astype(float)
    same, _, diff = compare(mu, mu, mu, rewards, resamples=500)
    assert same.estimate.value == rewards.mean() and abs(same.ess - n) < 1e-6
    assert diff.value == 0 and diff.low == 0 and diff.high == 0
    # a target policy that picks "good" with probability 0.9 earns 0.9
    target = np.where(good, np.log(0.9), np.log(0.1))
    cand, champ, gain = compare(target, mu, mu, rewards, resamples=500)
    assert cand.estimate.low < 0.9 < cand.estimate.high and abs(cand.estimate.value - 0.9) < 0.02
    assert gain.low > 0.35 and cand.ess < n
    # paired: the improvement's interval is tighter than the two intervals side by side
    assert gain.high - gain.low < (cand.estimate.high - cand.estimate.low) + (champ.estimate.high - champ.estimate.low)


def test_a_candidate_that_moved_off_the_logged_completions_gets_no_credit_for_it():
    # mu logged "good" (reward 1) or "bad" (0), each with probability 1/2. The candidate gives
    # "good" 0.5 too but moves the rest to completions never logged (they would earn nothing):
    # it is worth 0.5, like the champion (= mu). SNIS renormalises onto "good" and says 1.0.
    rng = np.random.default_rng(1)
    n = 4000
    mu = np.log(np.full(n, 0.5))
    good = rng.random(n) < 0.5
    rewards = good.astype(float)
    cand_lp = np.where(good, np.log(0.5), np.log(1e-6))
    cand, champ, gain = compare(cand_lp, mu, mu, rewards, resamples=500)
    assert cand.estimate.value > 0.99  # the self-normalised estimate alone would pass it...
    assert gain.low <= 0 and abs(gain.value) < 0.05  # ...the improvement the gate reads (must exceed 0) does not
    # and the estimate says how much of the candidate the log covers: half (the "good" half)
    assert abs(cand.coverage - 0.5) < 0.03 and champ.coverage == 1.0


def test_a_coverage_bound_rejects_a_candidate_the_log_covers_too_little_of():
    cfg = GateConfig(bounds={"coverage": Bound(min=0.8)})
    metrics = {
        "abstention_rate": 0.0,
        "repetition_rate": 0.0,
        "tool_format_error_rate": 0.0,  # the default
        "tool_format_error_rate_after_result": 0.0,
        "mean_length": 40.0,
        "smoke_latency_ms": 12.0,
    }  # bounds
    champion = EvalReport("1", Estimate(0.1, 0.0, 0.2), ess=200, metrics={**metrics, "coverage": 1.0})
    covered = EvalReport("candidate", Estimate(0.3, 0.2, 0.4), ess=50, metrics={**metrics, "coverage": 0.9})
    uncovered = EvalReport("candidate", Estimate(0.3, 0.2, 0.4), ess=50, metrics={**metrics, "coverage": 0.5})
    comparison = Comparison(Estimate(0.2, 0.1, 0.3), kl=0.1)
    assert decide(covered, champion, comparison, cfg).passed
    assert decide(uncovered, champion, comparison, cfg).reasons == ["coverage 0.5 (min 0.8)"]


def test_a_champion_that_failed_to_generate_fails_the_gate_closed():
    """Its metrics are missing: every relative check used to be 'not applicable' and pass."""
    cfg = GateConfig(
        min_ess=1, bounds={"abstention_rate": Bound(max_increase=0.05), "mean_length": Bound(max_rel_decrease=0.5)}
    )
    candidate = EvalReport(
        "candidate", Estimate(0.5, 0.4, 0.6), ess=50, metrics={"abstention_rate": 0.9, "mean_length": 1.0}
    )
    broken = EvalReport(
        "3",
        Estimate(float("nan"), float("nan"), float("nan")),
        ess=0.0,
        smoke_ok=False,
        smoke_error="CUDA error: out of memory",
    )
    for first in (False, True):  # the champion, or the base model of a first deployment
        decision = decide(candidate, broken, Comparison(Estimate(0.2, 0.1, 0.3), 0.01), cfg, first=first)
        failing = {c.name for c in decision.checks if not c.passed}
        assert not decision.passed and {"champion_measured", "bound:abstention_rate", "bound:mean_length"} <= failing
        assert any("out of memory" in r for r in decision.reasons)
