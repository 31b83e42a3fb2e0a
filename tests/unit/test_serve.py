"""The vLLM hook's adapter bookkeeping against vLLM's two adapter endpoints (stubbed at the call):
a cleared champion loads nothing, an alias that keeps failing does not hold up the other, and an
old adapter is unloaded only after its grace period and not while it is needed again."""

from __future__ import annotations

import os

import pytest

import deploy.serving.start as start
from deploy.serving.follow import Follower
from deploy.serving.vllm import VllmAdapterSync
from pipeline.core.config import load_config
from pipeline.core.types import ModelUpdate


def test_a_cleared_champion_alias_loads_nothing_into_vllm(tmp_path):
    """The registry's champion alias cleared (its event carries no version): there is nothing to
    load, so vLLM keeps what it has (it once asked vLLM to load an adapter named `-vNone`)."""
    calls: list[tuple[str, dict]] = []
    sync = VllmAdapterSync("http://127.0.0.1:9", "m", lambda uri, dst: dst, tmp_path, grace_s=0.0)
    sync._post = lambda path, body: calls.append((path, body))
    sync.served = lambda: set()
    sync.on_update(ModelUpdate("champion", "3", "runs:/r/adapter"))
    sync.on_update(ModelUpdate("champion", None))
    assert [body["lora_name"] for _, body in calls] == ["m-v3"] and sync.current == "m-v3"


def test_an_alias_that_keeps_failing_does_not_hold_up_the_other():
    """A canary vLLM can never load (its rank over --max-lora-rank) is tried again on its own
    backoff; the champion's move is applied meanwhile (it waited behind the canary forever)."""
    applied: list[str] = []

    def on_update(update: ModelUpdate) -> None:
        if update.alias == "canary":
            raise RuntimeError("LoRA rank 64 is greater than max_lora_rank 16.")
        applied.append(update.version)

    follower = Follower.__new__(Follower)  # the retry logic alone: no consumer
    follower.on_update, follower.retry_s, follower.stale = on_update, 30.0, {"canary", "champion"}
    follower.next_try, follower.failures = {}, {}
    follower.resolve = lambda alias: ModelUpdate(alias, "5" if alias == "champion" else "6", "runs:/r/adapter")
    follower._apply()
    assert applied == ["5"] and follower.stale == {"canary"} and follower.failures == {"canary": 1}
    follower._apply()  # within the canary's backoff: not tried again yet
    assert follower.failures == {"canary": 1}


def test_an_old_adapter_is_unloaded_only_after_the_grace_period_and_not_if_needed_again(tmp_path):
    """vLLM unloaded the old champion at once: the gateway, still routing to it until its next
    poll, got 404s. Now the old name stays for grace_s -- and a rollback within it keeps it."""
    calls: list[tuple[str, str]] = []
    sync = VllmAdapterSync("http://127.0.0.1:9", "m", lambda uri, dst: dst, tmp_path, grace_s=3600)
    sync._post = lambda path, body: calls.append((path.rsplit("/", 1)[1], body["lora_name"]))
    sync.served = lambda: (
        {name for kind, name in calls if kind == "load_lora_adapter"}
        - {name for kind, name in calls if kind == "unload_lora_adapter"}
    )
    for version in ("3", "4", "3"):  # promoted, then rolled back within the grace period
        sync.on_update(ModelUpdate("champion", version, "runs:/r/adapter"))
    assert calls == [("load_lora_adapter", "m-v3"), ("load_lora_adapter", "m-v4")]  # m-v3 still loaded
    assert [t.args[0] for t in sync.timers] == ["m-v3", "m-v4"]  # each old name's grace period
    for timer in sync.timers:  # the grace periods end: what each timer runs
        timer.cancel()
        sync._unload_now(*timer.args)
    assert calls[2:] == [("unload_lora_adapter", "m-v4")] and sync.kept == ["m-v3"] and sync.current == "m-v3"


def test_keeping_vllm_on_the_registry_draws_no_download_bars(monkeypatch, tmp_path):
    """`rtrl serve --vllm` fetches each adapter from MLflow: its progress bars are not a
    service's output (serve_policy and the daemon turn them off; keep_vllm did not)."""
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)

    def no_broker(*a, **k):
        raise start.FollowFailed("follow model-updates", ConnectionError("no broker"))

    monkeypatch.setattr(start, "_follower", no_broker)
    job = start.ServeJob(load_config(environ={"RTRL_STATE_DIR": str(tmp_path)}), load_policy=lambda base: None)
    with pytest.raises(start.FollowFailed):
        start.keep_vllm(job, "http://127.0.0.1:1")
    assert os.environ.get("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR") == "false"
