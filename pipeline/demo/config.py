"""The demo's settings and its base models (the agent task's: pipeline/demo/agent.py).

The demo's settings are a layer like any other: on top of the embedded defaults, under the
user's config file and RTRL_* environment (so `RTRL_KAFKA__PORT=29392 rtrl demo` starts its
broker on 29392). Each run gets its own store, MLflow store, topics and model name under
`<state>/demo[-naive]/`, written to `<state>/demo[-naive]/rtrl.toml` so that every other command
can look at what the run did (`rtrl --config <state>/demo/rtrl.toml status`, ...).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pipeline.core.config import Config, load_config, to_toml

DEMO_SPEC = Path(__file__).with_name("demo_spec.toml")
NAIVE_SPEC = Path(__file__).with_name("demo_spec_naive.toml")
AGENT_SPEC = Path(__file__).with_name("agent_spec.toml")
AGENT_NAIVE_SPEC = Path(__file__).with_name("agent_spec_naive.toml")
TASKS = ("reverse", "agent")


def base_dir(state_dir: Path, task: str) -> Path:
    """Where the demo's own base model of `task` is built, once per state folder."""
    return state_dir / ("demo-agent-base" if task == "agent" else "demo-base")


def run_dir_name(task: str, naive: bool) -> str:
    return ("demo-agent" if task == "agent" else "demo") + ("-naive" if naive else "")


def demo_settings(
    state_dir: Path, run_dir: Path, naive: bool, every: str, seed: int, tag: str, task: str = "reverse"
) -> dict[str, Any]:
    """The user's state folder (and so their local broker) with this run's own store, MLflow
    store, topics and model name: every demo starts from nothing and re-reads nothing."""
    settings = {
        "state_dir": str(state_dir),
        "store": {"url": f"sqlite:///{run_dir / 'rtrl.db'}"},
        "kafka": {
            "interactions_topic": f"rtrl-demo-{tag}.interactions",
            "feedback_topic": f"rtrl-demo-{tag}.feedback",
            "model_updates_topic": f"rtrl-demo-{tag}.model-updates",
            "partitions": 2,
        },
        "ingest": {"group_id": f"rtrl-demo-{tag}"},
        "reward": {"spec": str(NAIVE_SPEC if naive else DEMO_SPEC)},
        "train": {
            "base_model": str(base_dir(state_dir, "reverse")),
            "learning_rate": 3e-3,
            "epochs": 6,
            "batch_tokens": 2048,
            "max_seq_len": 64,
            "lora_r": 8,
            "lora_alpha": 16,
            "seed": seed,
            "holdout_percent": 30.0,
            "staleness_s": 3600,
            "max_episodes": 4000,
            # single answers are within a few tokens of each other: grouping saves no padding
            # here, and the demo keeps the packing its recorded runs used (the agent's groups)
            "group_by_length": False,
        },
        "gate": {
            "max_new_tokens": 8,
            "min_ess": 3,
            "max_kl": 3.0,
            "generate_prompts": 60,
            "eval_episodes": 400,
            "bounds": {"smoke_latency_ms": {"max_rel_increase": 5.0}},
        },
        "cycle": {"every": every, "min_new_episodes": 80},
        # a staged rollout on the compressed clock: a candidate that passes the gate answers half
        # of the requests while the sequential test (deploy/sequential.py) is looked at every 5 s,
        # ~60 settled requests a side at 24 tasks/s. A request's reward spreads ~0.64: a canary 5
        # points of accepts better (+0.067) is promoted ~9 times in 10, at a median ~290 a side
        # (~25 s), 10 points better at ~200; one worse than the margin at most 5 % of the time
        # (docs/benchmarks.md, "The canary's sequential test"). 800 a side (~70 s) ends a tie
        "rollout": {
            "share": 0.5,
            "min_requests": 50,
            "max_requests": 800,
            "margin": 0.05,
            "effect": 0.05,
            "check_every": "5s",
            "max_wait": "3m",
        },
        # the outcome model the gate's direct estimate scores fresh answers with: first fitted once
        # 500 episodes can be (a weaker one is judged unusable, and the gate falls back to
        # importance sampling), again every 2,000 new rewards, on the latest 3,000 for 6 epochs:
        # ~40 s a fit while the fleet runs, three fits a run
        "outcome": {"min_episodes": 500, "refresh_episodes": 2000, "max_episodes": 3000, "epochs": 6},
        "mlflow": {"tracking_uri": f"sqlite:///{run_dir / 'mlflow.db'}", "experiment": "rtrl-demo"},
    }
    if task == "agent":
        # an episode is two calls (~25 + 28 tokens, then ~5 + 5) with the tool's result between them:
        # fewer, longer sequences per cycle than the single-turn task's; the gate's greedy answers
        # must have room for a whole tool call; a candidate that writes more broken calls than the
        # champion is refused by the gate's tool-format canary and, staged, by the online one
        settings["reward"] = {"spec": str(AGENT_NAIVE_SPEC if naive else AGENT_SPEC)}
        # a KL penalty to the base keeps the call's format: without it the updates that teach the
        # answer move the call's near-certain tokens too (at lr 3e-3 every sampled call of a
        # candidate broke; docs/benchmarks.md "The agent demo")
        # batch_tokens 2560: micro-batches grouped by length (train.group_by_length) take as many steps
        # as 4096 did mixed, in half the time
        settings["train"].update(
            base_model=str(base_dir(state_dir, task)),
            max_seq_len=96,
            epochs=3,
            group_by_length=True,
            max_episodes=800,
            batch_tokens=2560,
            learning_rate=1e-3,
            kl_coef=0.2,
        )
        # mean_length: a policy that learns to answer after a call instead of calling again, or
        # the reverse, changes its mean answer length by design (a call is 28 tokens, an answer ~5)
        settings["gate"].update(
            max_new_tokens=40,
            generate_prompts=40,
            eval_episodes=300,
            bounds={
                "smoke_latency_ms": {"max_rel_increase": 5.0},
                "mean_length": {"max_rel_increase": 5.0, "max_rel_decrease": 0.95},
                # first calls: a policy that learns to use the tool writes more calls, and with them more
                # broken ones at the base's ~4 % a call (0.02 refused every proper candidate of a seed-0
                # run, +3 to +5 pp); after a tool's result a call is never right here: 0.02
                "tool_format_error_rate": {"max": 0.3, "max_increase": 0.05},
                "tool_format_error_rate_after_result": {"max": 0.3, "max_increase": 0.02},
            },
        )
        # the agent fleet settles ~2 episodes a second a side and an episode's reward spreads ~0.8:
        # a 0.15 margin and a 0.1 effect size the test at ~130 episodes a side for the fixed-size
        # test (the sequential one decides a candidate 0.1 better at ~90); 240 a side ends a tie
        # within the run's minutes (a 0.05 margin would need ~450)
        settings["rollout"].update(
            max_tool_error_increase=0.02, margin=0.15, effect=0.1, min_requests=40, max_requests=240
        )
        # ~1.7 calls an episode at ~4 episodes/s: a cycle starts once 200 new calls are rewarded
        # (`--every` 10s only looks), so each trains on fresh data however long the last one took
        settings["cycle"]["min_new_episodes"] = 200
        # the gate decides by importance sampling here: the outcome model is not yet measured
        # against the truth on agent episodes (benchmarks/offpolicy_vs_online.py has the
        # single-turn demo's oracle only), and its fits would take minutes of the run
        settings["gate"]["estimator"] = "importance"
        settings["outcome"] = {"enabled": False}
    return settings


def demo_config(
    config_path: str | Path | None,
    state_dir: Path,
    run_dir: Path,
    naive: bool,
    every: str,
    seed: int,
    tag: str,
    task: str = "reverse",
) -> Config:
    """The demo's settings under the user's file and environment (see the module docstring)."""
    return load_config(config_path, under=demo_settings(state_dir, run_dir, naive, every, seed, tag, task))


def write_config(config: Config, path: Path) -> Path:
    path.write_text(
        "# written by `rtrl demo`: the settings of this run (rtrl --config THIS_FILE ...)\n" + to_toml(config)
    )
    return path


BASE_RECIPE = {
    "arch": "llama",
    "hidden": 128,
    "layers": 2,
    "heads": 4,
    "warmup_steps": 1000,
    "behaviour": "sim.base_behaviour: 3-5 letters reverse 0.3, decline 0.05, copy 0.65; "
    "6 letters decline 0.15, copy 0.85",
}


def build_base(out: Path, seed: int, say=print) -> Path:
    """The demo's base model, built once per state folder (rebuilt when the recipe changes)."""
    from pipeline.demo.sim import base_behaviour
    from train.models import init_tiny
    from train.warmup import warm_up

    recipe = {**BASE_RECIPE, "seed": seed}
    marker = out / "rtrl_base_recipe.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return out
    say(
        f"building the base model: a tiny {recipe['arch']} ({recipe['layers']} layers, width {recipe['hidden']}), "
        f"{recipe['warmup_steps']} supervised warm-up steps (about a minute, once per state folder)"
    )
    shutil.rmtree(out, ignore_errors=True)
    init_tiny(
        out, arch=recipe["arch"], hidden=recipe["hidden"], layers=recipe["layers"], heads=recipe["heads"], seed=seed
    )
    warm_up(out, base_behaviour, steps=recipe["warmup_steps"], seed=seed)
    marker.write_text(json.dumps(recipe, indent=2))
    return out
