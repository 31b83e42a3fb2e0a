"""deploy/estimators.py on synthetic logs whose true values are known exactly: prompts x, five
kinds of answer a with a known mean reward m(x, a), a behaviour policy that logged mostly
answers 0-2, and candidates that stay on or drift off those answers; and the sample of prompts
the policies answer afresh."""

import zlib

import numpy as np
import pytest

from deploy.estimators import choose, direct, doubly_robust, prompt_means
from deploy.fresh import fresh_prompts
from deploy.offpolicy import compare
from pipeline.core.types import LoggedEpisode

P, N, K, A = 400, 4000, 4, 5
RNG = np.random.default_rng(0)
M = RNG.random((P, A)) * np.array([0.6, 0.8, 0.7, 0.0, 0.1])  # [P, A] m(x, a)
M[:, 3] = 0.9  # an answer the behaviour (almost) never writes, better than any it does
MU = np.array([0.4, 0.3, 0.299, 0.0005, 0.0005])  # behaviour: answers 3 and 4 almost never logged
CHAMPION = np.array([0.4, 0.3, 0.3, 0.0, 0.0])
ON_SUPPORT = np.array([0.1, 0.7, 0.2, 0.0, 0.0])  # better, on the logged answers
WORSE_OFF = np.array([0.05, 0.05, 0.05, 0.05, 0.8])  # mostly answer 4, which earns ~0.05
BETTER_OFF = np.array([0.05, 0.05, 0.05, 0.8, 0.05])  # mostly answer 3, which earns 0.9


def truth(policy):
    return float((M * policy).sum(axis=1).mean())


def logged(seed=1):
    rng = np.random.default_rng(seed)
    x, a = rng.integers(0, P, N), rng.choice(A, N, p=MU)
    r = (rng.random(N) < M[x, a]).astype(float)
    return x, a, r


def fresh(policy, q, seed):
    """[P] each prompt's mean score q(x, y) over K sampled answers y ~ policy."""
    rng = np.random.default_rng(seed)
    answers = rng.choice(A, (P, K), p=policy)
    return prompt_means([[q[p, y] for y in row] for p, row in enumerate(answers)])


def logp(policy, a):
    with np.errstate(divide="ignore"):
        return np.log(policy[a])


@pytest.mark.parametrize(
    "candidate", [ON_SUPPORT, WORSE_OFF, BETTER_OFF], ids=["on-support", "worse-off", "better-off"]
)
def test_direct_and_doubly_robust_recover_the_truth_where_importance_sampling_does_not(candidate):
    true_gain = truth(candidate) - truth(CHAMPION)
    x, a, r = logged()
    q = M  # a calibrated outcome model
    d = direct(fresh(candidate, q, 2), fresh(CHAMPION, q, 3), seed=0)
    assert d.improvement.low < true_gain < d.improvement.high
    assert abs(d.improvement.value - true_gain) < 0.03
    v_cand, v_champ = fresh(candidate, q, 4), fresh(CHAMPION, q, 5)
    dr = doubly_robust(v_cand[x], v_champ[x], q[x, a], r, logp(candidate, a), logp(CHAMPION, a), logp(MU, a))
    assert abs(dr.improvement.value - true_gain) < 0.03
    # coverage: E_mu[min(pi/mu, 20)], the share of the candidate's probability the clipped weights see
    assert dr.diagnostics["coverage_candidate"] == pytest.approx((MU * np.minimum(candidate / MU, 20)).sum(), abs=0.05)
    cand_is, champ_is, gain = compare(logp(candidate, a), logp(CHAMPION, a), logp(MU, a), r, seed=0)
    snis = cand_is.estimate.value - champ_is.estimate.value
    if candidate is ON_SUPPORT:
        assert abs(snis - true_gain) < 0.05 and abs(gain.value - true_gain) < 0.05
    else:
        # the clipped weights see under a third of it: SNIS renormalises that onto the logged
        # answers (a worse candidate looks as good as the champion), plain IS counts the rest as
        # earning 0 (a better one looks worse); the gate's cautious pick misses the better one
        assert dr.diagnostics["coverage_candidate"] < 0.35
        if candidate is WORSE_OFF:
            assert true_gain < -0.2 and snis - true_gain > 0.2
        else:
            assert true_gain > 0.3 and true_gain - gain.value > 0.3


def test_doubly_robust_corrects_an_outcome_model_biased_on_the_logged_answers():
    # q over-rates answer 1 by 0.3; the candidate favours answer 1, which the log covers well
    x, a, r = logged(seed=6)
    q = M.copy()
    q[:, 1] += 0.3
    true_gain = truth(ON_SUPPORT) - truth(CHAMPION)
    d = direct(fresh(ON_SUPPORT, q, 7), fresh(CHAMPION, q, 8))
    assert d.improvement.value - true_gain > 0.1  # the direct estimate inherits the model's bias
    dr = doubly_robust(
        fresh(ON_SUPPORT, q, 9)[x],
        fresh(CHAMPION, q, 10)[x],
        q[x, a],
        r,
        logp(ON_SUPPORT, a),
        logp(CHAMPION, a),
        logp(MU, a),
    )
    assert abs(dr.improvement.value - true_gain) < 0.04


def test_paired_bootstrap_over_prompts_is_tighter_than_independent_sides():
    rng = np.random.default_rng(11)
    base = rng.random(P)  # prompt difficulty shared by both policies
    cand, champ = base + 0.02 + 0.01 * rng.standard_normal(P), base + 0.01 * rng.standard_normal(P)
    d = direct(cand, champ)
    assert d.improvement.low > 0  # paired: the prompts' spread (~0.29) cancels
    assert d.improvement.high - d.improvement.low < 0.01
    assert d.n == P


def test_prompts_without_scores_are_left_out_and_none_is_an_explained_absence():
    cand = np.array([0.5, np.nan, 0.7])
    champ = np.array([0.4, 0.3, np.nan])
    assert direct(cand, champ).n == 1
    empty = direct(np.array([np.nan]), np.array([0.1]))
    assert empty.improvement is None and "no held-out prompt" in empty.why_not
    assert prompt_means([[None, 0.2, 0.4], [None]]).tolist()[0] == pytest.approx(0.3)


def test_choose_says_which_estimator_decided_and_why():
    from deploy.estimators import Estimated
    from deploy.gate import Estimate

    est = {
        "direct": Estimated("direct", None, why_not="no outcome model"),
        "importance": Estimated("importance", Estimate(0.1, 0.02, 0.2)),
    }
    c = choose(est, "direct", "importance", "is too weak: AUROC 0.55 (min 0.7)")
    assert c.estimator == "importance" and c.improvement.low == 0.02
    assert c.note == (
        "fell back to importance sampling: direct could not be computed (the outcome model is too "
        "weak: AUROC 0.55 (min 0.7))"
    )
    refused = choose(est, "direct", "refuse", "is too weak")
    assert refused.refused and refused.improvement is None and "gate.fallback = 'refuse'" in refused.note
    est["direct"] = Estimated("direct", Estimate(0.05, 0.01, 0.09), 60)
    assert choose(est, "direct", "importance", "").note == ""


def test_fresh_prompts_are_a_sample_of_requests_not_of_distinct_prompts():
    """Users ask one easy prompt 90 % of the time and 200 rare ones once each: the prompts the
    policies answer afresh must be asked as often as users ask them, else the direct estimate
    values the policies on the rare prompts' mix."""
    common = [LoggedEpisode(f"c{i}", "easy>", "") for i in range(1800)]
    rare = [LoggedEpisode(f"r{i}", f"rare-{i}>", "") for i in range(200)]
    chosen = fresh_prompts(common + rare, 100, lambda e: zlib.crc32(e.request_id.encode()))
    assert len(chosen) == 100
    share = sum(e.prompt == "easy>" for e in chosen) / len(chosen)
    assert 0.8 <= share <= 0.97, share  # ~0.9 (one per distinct prompt: 1 in 100)
