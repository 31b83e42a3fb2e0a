"""The outcome model (train/outcome.py) on the reverse task: it learns which answers earn the
reward, its calibrated predictions match the rewards of prompts it never saw, and a model of
rewards that carry no signal is judged unusable; the newest fit is what `rtrl reward model show`
and `rtrl status` report."""

import json
import random

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.config import OutcomeConfig, TrainConfig
from pipeline.core.types import LoggedEpisode, task_key
from tests.support import reverse_task
from train.outcome import OutcomeModel, fit, split_of
from train.outcome_record import MANIFEST, point_at
from train.outcome_stage import fitted_as_asked

TRAIN = TrainConfig(max_seq_len=32, seed=0)
# ~160 checked episodes: a calibration error measured on 10 bins of 16 is noisy by ~0.03
CFG = OutcomeConfig(min_episodes=100, epochs=6, batch_size=32, max_calibration_error=0.1)


def answers(prompts, rng, noise=False):
    """Each prompt answered right (reward 1), copied or shuffled (0); `noise`: rewards drawn
    at random, whatever the answer."""
    out = []
    for k, s in enumerate(prompts):
        for kind in ("right", "copy", "shuffled"):
            text = {"right": s[::-1], "copy": s, "shuffled": "".join(rng.sample(s, 3))}[kind]
            r = float(rng.random() < 0.5) if noise else reverse_task.reward(s, text)
            out.append(LoggedEpisode(f"{s}-{kind}-{k}", reverse_task.prompt_text(s), text, reward=r))
    return out


@pytest.fixture(scope="module")
def fitted(reverse_base, tmp_path_factory):
    rng = random.Random(0)
    episodes = answers(reverse_task.PROMPTS * 2, rng)
    return fit(
        reverse_base,
        episodes,
        [task_key(e.prompt) for e in episodes],
        tmp_path_factory.mktemp("outcome") / "m",
        CFG,
        TRAIN,
        window={"reward_ids": [1, len(episodes)]},
    )


def test_the_split_is_by_task_and_apart_from_the_holdout():
    sides = {split_of(task_key(reverse_task.prompt_text(s)), 30.0) for s in reverse_task.PROMPTS}
    assert sides == {"fit", "calibrate", "check"}
    shares = [split_of(str(i).encode(), 30.0) for i in range(20_000)]
    assert shares.count("fit") / 20_000 == pytest.approx(0.7, abs=0.02)
    assert shares.count("check") / 20_000 == pytest.approx(0.15, abs=0.02)


def test_it_learns_the_reward_and_is_calibrated_on_tasks_it_never_saw(fitted):
    q = fitted.quality
    assert fitted.usable, fitted.why
    assert q.auroc > 0.9 and q.calibration_error < 0.1 and q.r2 > 0.5, q
    assert sum(fitted.episodes.values()) == 2 * 3 * len(reverse_task.PROMPTS)
    assert fitted.window == {"reward_ids": [1, 360 * 3]}


def test_a_saved_model_scores_fresh_answers(fitted):
    model = OutcomeModel.load(fitted.path)
    unseen = [s for s in reverse_task.PROMPTS if split_of(task_key(reverse_task.prompt_text(s)), 30.0) == "check"]
    right = model.score([LoggedEpisode("r", reverse_task.prompt_text(s), s[::-1]) for s in unseen])
    copy = model.score([LoggedEpisode("c", reverse_task.prompt_text(s), s) for s in unseen])
    assert np.mean(right) > 0.75 and np.mean(copy) < 0.2


def test_a_model_of_either_pooling_loads_back_as_it_was_saved(fitted, reverse_base, tmp_path):
    """The head's input (the last token's state, or that and the completion's mean) is in the
    manifest: a model loads back with the pooling it was fitted with, and scores as it did."""
    rng = random.Random(1)
    episodes = answers(reverse_task.PROMPTS, rng)
    quick = fit(
        reverse_base,
        episodes,
        [task_key(e.prompt) for e in episodes],
        tmp_path / "last",
        CFG.model_copy(update={"epochs": 1, "min_episodes": 40, "pooling": "last"}),
        TRAIN,
    )
    for path, pooling in ((quick.path, "last"), (fitted.path, "mean")):
        again = OutcomeModel.load(path)  # a head of the other pooling's width would not load
        hidden = again.policy.model.config.hidden_size
        assert again.pooling == pooling and again.head.in_features == (2 if pooling == "mean" else 1) * hidden
        assert all(v is not None for v in again.score(episodes[:12]))


def test_a_change_of_pooling_is_a_new_fit_not_a_reload(fitted, reverse_base):
    """The cycle reloads the last fit only if it was made as the config now asks: a head of the
    other pooling would read features it was never fitted on."""
    manifest = json.loads((fitted.path / MANIFEST).read_text())
    base, spec = manifest["base_model"], manifest["window"].get("spec_version")
    assert fitted_as_asked(manifest, base, spec, CFG)  # fitted with the default, "mean"
    assert not fitted_as_asked(manifest, base, spec, CFG.model_copy(update={"pooling": "last"}))
    older = {k: v for k, v in manifest.items() if k != "pooling"}  # a fit from before the setting
    assert fitted_as_asked(older, base, spec, CFG.model_copy(update={"pooling": "last"}))
    assert not fitted_as_asked(older, base, spec, CFG)
    assert not fitted_as_asked(manifest, base + "-other", spec, CFG)


def test_rewards_without_signal_make_an_unusable_model(reverse_base, tmp_path):
    rng = random.Random(1)
    episodes = answers(reverse_task.PROMPTS, rng, noise=True)
    weak = fit(
        reverse_base,
        episodes,
        [task_key(e.prompt) for e in episodes],
        tmp_path / "m",
        CFG.model_copy(update={"epochs": 1}),
        TRAIN,
    )
    assert not weak.usable and weak.why.startswith("too weak"), weak.why


def test_too_few_episodes_is_a_clear_error(reverse_base, tmp_path):
    episodes = answers(reverse_task.PROMPTS[:10], random.Random(2))
    with pytest.raises(ValueError, match="too few rewarded episodes.*outcome.min_episodes"):
        fit(reverse_base, episodes, [task_key(e.prompt) for e in episodes], tmp_path / "m", CFG, TRAIN)


def test_the_newest_fit_is_shown_where_a_user_looks(fitted, tmp_path):
    env = {"RTRL_STATE_DIR": str(tmp_path), "RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    runner = CliRunner()
    none = runner.invoke(cli, ["reward", "model", "show"], env=env)
    assert none.exit_code != 0 and "no outcome model under" in none.output, none.output
    (tmp_path / "outcome").mkdir()
    point_at(tmp_path, fitted.path)
    shown = runner.invoke(cli, ["reward", "model", "show"], env=env)
    assert shown.exit_code == 0, shown.output
    q = fitted.quality
    assert f"AUROC {q.auroc:.3f}" in shown.output and f"calibration error {q.calibration_error:.3f}" in shown.output
    assert ("usable: " if fitted.usable else "unusable: ") + fitted.why in shown.output
    assert ("decides (direct)" if fitted.usable else "NOT USED: the gate falls back") in shown.output
    assert f"fit {fitted.episodes['fit']}, calibrate {fitted.episodes['calibrate']}" in shown.output
    as_json = json.loads(runner.invoke(cli, ["reward", "model", "show", "--json"], env=env).output)
    assert as_json["path"] == str(fitted.path) and as_json["window"] == fitted.window
    assert runner.invoke(cli, ["db", "upgrade"], env=env).exit_code == 0
    status = runner.invoke(cli, ["status"], env=env)
    used = "decides (direct)" if fitted.usable else "NOT USED: the gate falls back to importance sampling"
    assert f"outcome model: {used}; AUROC {q.auroc:.3f}" in status.output, status.output
    (tmp_path / "outcome" / "latest.json").write_text("{not json")  # a torn record: said, not a crash
    broken = runner.invoke(cli, ["status"], env=env)
    assert broken.exit_code == 0 and "cannot read the outcome model's record" in broken.output, broken.output
