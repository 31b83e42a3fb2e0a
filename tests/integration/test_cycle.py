"""The cycle: two full cycles end to end (events through the real broker, SQLite, the local MLflow
store, a tiny model), a cycle with too little new data skipped, cycles resumed after a crash
in training and in evaluation completing exactly once, and one stopped by its daemon's shutdown
resumed by the next start."""

from __future__ import annotations

import pytest
from sqlalchemy import select

import train.run
from deploy.registry import CHAMPION
from deploy.stage import adapter_name
from pipeline import cycle as cycle_mod
from pipeline.core.store.cycles import cycle_split, decision_for_run
from pipeline.core.store.tables import training_runs
from pipeline.core.store.training import get_run
from pipeline.cycle import run_cycle
from tests.support.cycle import cycle_deps, feed

# the cycle runs on SQLite and the local MLflow store here (PostgreSQL + an MLflow server: test_deploy_registry)
pytestmark = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)


@pytest.fixture
def deps(cfg, engine, reverse_base, tmp_path):
    return cycle_deps(cfg, engine, reverse_base, tmp_path)


def test_two_full_cycles_then_a_skip(deps, cfg, engine, topics, kafka_bootstrap, reverse_base):
    assert feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "a", seed=6) > 0
    first = run_cycle(deps)
    assert first.state == "done" and first.promoted == 1, first.reason
    assert deps.registry.alias(CHAMPION).version == first.candidate_version
    assert {"reward", "train", "evaluate", "promote"} <= set(first.timings)

    assert feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "b", seed=7) > 0
    second = run_cycle(deps)
    assert second.state in ("done", "rejected"), second.reason
    run = get_run(engine, second.run_id)
    assert run.parent_run_id == first.run_id and run.watermark_from == get_run(engine, first.run_id).watermark_to
    champion = deps.registry.alias(CHAMPION).version
    assert champion == (second.candidate_version if second.state == "done" else first.candidate_version)
    # the runner kept between cycles holds the champion (and, when it was just replaced, the one
    # before it, until the next gate); a rejected candidate is unloaded. The second cycle trained
    # from the champion's adapter, downloaded once into the cache
    held = {adapter_name(deps.registry.get(v)) for v in {champion, first.candidate_version}}
    assert deps.make_runner(reverse_base).names == held
    assert [p.name.split("-")[-2] for p in deps.registry.cache_dir.iterdir()] == ["v1"]
    # where each stage's seconds went is recorded: the training run's split, the gate's
    assert {"load", "tokenize", "loop", "save"} <= set(run.summary["split_s"])
    gate_seconds = decision_for_run(engine, second.run_id).report["seconds"]
    assert {"registry", "load", "generate", "log_probs"} <= set(gate_seconds)
    split = cycle_split(engine, second, run)  # ... and the two put together with the stage timings
    assert split["train.loop"] == run.summary["split_s"]["loop"] and split["evaluate.generate"] > 0
    assert abs(sum(split.values()) - sum(second.timings.values())) < 0.01
    # every second of the cycle is in some stage: the parent adapter's download, and the state
    # writes and lookups between stages (`bookkeeping`), are counted too
    assert {"parent", "bookkeeping"} <= set(second.timings) and "parent" not in first.timings
    assert 0 < second.timings["bookkeeping"] < sum(second.timings.values())

    # the champion's watermark: after a promotion nothing is new; after a rejection the same
    # episodes are still new (the champion never learned from them) -- either way, too few
    deps.config.cycle.min_new_episodes = 10_000
    third = run_cycle(deps)
    assert third.state == "skipped" and "fewer than cycle.min_new_episodes" in third.reason
    assert third.run_id is None and deps.registry.alias(CHAMPION).version == champion


def test_a_cycle_interrupted_in_training_or_evaluation_completes_exactly_once(
    deps, cfg, engine, topics, kafka_bootstrap, reverse_base, monkeypatch
):
    feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "c", seed=8)

    def crash(*a, **k):
        raise KeyboardInterrupt("killed")

    with monkeypatch.context() as m:  # the process dies in the middle of the training loop
        m.setattr(train.run, "train_policy", crash)
        with pytest.raises(KeyboardInterrupt):
            run_cycle(deps)
    with monkeypatch.context() as m:  # the restarted process dies in the middle of the gate
        m.setattr(cycle_mod, "gate_run", crash)
        with pytest.raises(KeyboardInterrupt):
            run_cycle(deps)
    done = run_cycle(deps)  # the next start finishes it
    assert done.state == "done" and done.promoted == 1, done.reason
    with engine.connect() as conn:
        runs = conn.execute(select(training_runs.c.run_id, training_runs.c.status)).all()
    assert sorted(status for _, status in runs) == ["failed", "finished"]  # the killed one, the one that counts
    assert dict(runs)[done.run_id] == "finished"
    assert [v.version for v in deps.registry.list()] == [done.candidate_version] == ["1"]


def test_a_daemon_shutting_down_stops_its_cycle_at_the_next_step_and_the_next_start_finishes_it(
    deps, cfg, engine, topics, kafka_bootstrap, reverse_base, monkeypatch
):
    """A cycle left running while its process exits went on into the interpreter's shutdown:
    its outcome model could no longer load, the gate fell back to importance sampling, and what
    that passed was staged as a canary nobody measured. Now it stops at its next training step
    (or stage), writes nothing more, and the next start resumes it."""
    import threading

    from pipeline.core.store.cycles import unfinished_cycle

    feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "s", seed=9)
    deps.stopping = threading.Event()
    real = train.run.train_policy

    def shut_down_at_step_two(*a, on_step, **k):
        def step(n, total, *rest):
            if n == 2:
                deps.stopping.set()  # SIGTERM arrives during the training loop
            on_step(n, total, *rest)

        return real(*a, on_step=step, **k)

    with monkeypatch.context() as m:
        m.setattr(train.run, "train_policy", shut_down_at_step_two)
        assert run_cycle(deps) is None
    stopped = unfinished_cycle(engine)
    assert stopped.state == "training" and get_run(engine, stopped.run_id).status == "failed"
    assert deps.registry.list() == []  # nothing gated, nothing staged
    assert run_cycle(deps) is None and unfinished_cycle(engine).state == "training"  # still stopping: no work
    deps.stopping.clear()  # the next start
    done = run_cycle(deps)
    assert done.cycle_id == stopped.cycle_id and done.state == "done" and done.promoted == 1, done.reason
    assert [v.version for v in deps.registry.list()] == ["1"]


def test_a_rejected_candidate_is_trained_again_only_with_new_episodes(
    deps, cfg, engine, topics, kafka_bootstrap, reverse_base
):
    feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "r", seed=9)
    deps.config.gate.max_kl = 1e-9  # no candidate passes
    first = run_cycle(deps)
    assert first.state == "rejected" and "KL" in first.reason, first.reason
    # its episodes are still new to the champion (the base), but not to a candidate: no retraining
    again = run_cycle(deps)
    assert again.state == "skipped" and again.run_id is None, again.reason
    assert f"0 new rewarded episodes since run {first.run_id[:12]}" in again.reason
    assert len(deps.registry.list()) == 1

    feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "s", seed=10)
    third = run_cycle(deps)
    assert third.state == "rejected" and third.run_id != first.run_id, third.reason
    old, new = get_run(engine, first.run_id), get_run(engine, third.run_id)
    assert new.watermark_from == old.watermark_from == 0  # both from the base: old episodes and new ones
    assert new.watermark_to > old.watermark_to and new.episodes > old.episodes
