"""`rtrl reward`: compute rewards from stored outcomes, and look inside them."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from datetime import datetime, timedelta

import click
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from pipeline.cli.common import CONTEXT_SETTINGS, Context, outcome_model, pass_ctx
from pipeline.core.config import GateConfig
from reward.analysis import audit as audit_canaries
from reward.analysis import diff_specs
from reward.spec import RewardSpec, SpecError, load_spec
from reward.stage import explain as explain_call
from reward.stage import explain_episode as explain_calls
from reward.stage import run_rewards
from train.outcome_record import gate_use
from train.outcome_record import latest as latest_outcome_model

SPEC_OPTION = click.option(
    "--spec",
    "spec_path",
    type=click.Path(dir_okay=False),
    help="Reward spec TOML (default: reward.spec from the config, else the spec shipped with rtrl).",
)


def reward_spec(ctx: Context, path: str | None) -> RewardSpec:
    """The spec a command uses: --spec, else reward.spec, else the shipped one; a bad file is a clean error."""
    try:
        return load_spec(path or ctx.config.reward.spec)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None


WORKERS_OPTION = click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Processes to score with; 0 picks one per 25,000 stored episodes, up to the CPU count "
    "(at most 4). A spec with a judge always runs in one.",
)


@contextmanager
def _progress():
    """A progress line (episodes scanned, rewards written) on a terminal; silent otherwise."""
    if not sys.stdout.isatty():
        yield None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("scoring episodes")

        def update(report) -> None:
            bar.update(
                task,
                description=f"{report.episodes:,} episodes scanned, "
                f"{report.computed + report.updated:,} rewards written",
            )

        yield update


@click.group(context_settings=CONTEXT_SETTINGS)
def reward() -> None:
    """Turn delayed outcomes (accepted, edited, reverted, ...) into one reward per episode.

    A reward spec (TOML) says how each feedback kind counts, when an outcome is final
    (ripeness) and which outputs are penalised whatever users said (guards).
    """


@reward.command()
@SPEC_OPTION
@WORKERS_OPTION
@pass_ctx
def run(ctx: Context, spec_path: str | None, workers: int) -> None:
    """Compute rewards for ripe episodes; update those with late feedback. Incremental and
    idempotent: running it twice changes nothing."""
    spec = reward_spec(ctx, spec_path)
    with _progress() as on_progress:
        report = run_rewards(ctx.engine(), spec, on_progress=on_progress, workers=workers)
    click.echo(report.summary())
    if report.ignored_kinds:
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted(report.ignored_kinds.items()))
        click.echo(f"feedback kinds the spec does not weigh (add them to count them): {kinds}")


@reward.command()
@click.argument("request_id")
@click.option(
    "--episode",
    "is_episode",
    is_flag=True,
    help="The id is an agent episode's: show its calls, its outcome and each call's credited reward.",
)
@click.option(
    "--tenant", help="With --episode: the tenant whose episode it is (needed when several have one of that id)."
)
@SPEC_OPTION
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def explain(
    ctx: Context, request_id: str, is_episode: bool, tenant: str | None, spec_path: str | None, as_json: bool
) -> None:
    """Print an episode, its feedback and every component of its reward (with --episode, every
    call of an agent episode: its own feedback and guards, and its share of the outcome)."""
    spec = reward_spec(ctx, spec_path)
    if is_episode:
        try:
            found = explain_calls(ctx.engine(), spec, request_id, tenant=tenant)
        except ValueError as exc:
            raise click.ClickException(f"{exc} with --tenant") from None
        if not found:
            whose = f"tenant {tenant!r}'s " if tenant else ""
            raise click.ClickException(
                f"no interaction of {whose}episode {request_id!r} is stored "
                "(an episode id is the interactions' `episode_id`)"
            )
    else:
        one = explain_call(ctx.engine(), spec, request_id)
        if one is None:
            raise click.ClickException(
                f"no interaction with request_id {request_id!r} is stored (for an agent episode's id, add --episode)"
            )
        found = [one]
    if as_json:
        click.echo(
            json.dumps([_as_json(spec, *f) for f in found] if is_episode else _as_json(spec, *found[0]), indent=2)
        )
        return
    if is_episode:
        ep = found[0][0]
        click.echo(f"agent episode {request_id}: {len(found)} calls, spec {spec.version}")
        _print_feedback("outcome", ep.outcome, ep.ts)
        for k, (call, result, ripe) in enumerate(found):
            credited = sum(v for name, v in result.components.items() if name.startswith("episode."))
            click.echo(
                f"  call {k}  {call.request_id}  policy {call.policy_version}  "
                f"{len(call.tool_calls)} tool calls  outcome credited {credited:+.4f}  "
                f"reward {result.value:+.4f}" + ("" if ripe else "  (not ripe yet)")
            )
        return
    ep, result, ripe = found[0]
    text = ep.text if len(ep.text) <= 300 else ep.text[:300] + f"... ({len(ep.text)} chars)"
    click.echo(f"episode {ep.request_id}  policy {ep.policy_version}  at {ep.ts.isoformat()}Z")
    if ep.episode_id is not None:
        click.echo(
            f"call of agent episode {ep.episode_id} ({ep.episode_calls} calls, {ep.calls_after} after this "
            f"one): `rtrl reward explain --episode {ep.episode_id}` shows them all"
        )
    click.echo(f"output: {text!r}" + (f"  [{len(ep.tool_calls)} tool calls]" if ep.tool_calls else ""))
    _print_feedback("feedback", ep.feedback, ep.ts)
    if ep.episode_id is not None:
        _print_feedback("episode outcome", ep.outcome, ep.ts)
    click.echo(f"reward under {spec.version}" + ("" if ripe else " (not ripe yet: may still change)") + ":")
    for name, value in result.components.items():
        click.echo(f"  {name:<30} {value:+.4f}")
    if result.ignored_kinds:
        click.echo(f"  (ignored kinds: {', '.join(result.ignored_kinds)})")
    clipped = "" if result.value == result.unclipped else f"  (clipped from {result.unclipped:+.4f})"
    click.echo(f"  {'= reward':<30} {result.value:+.4f}{clipped}")


def _print_feedback(title: str, feedback: tuple, served: datetime) -> None:
    click.echo(f"{title}:" + ("" if feedback else " none"))
    for f in sorted(feedback, key=lambda f: (f.ts, f.event_id)):
        # the delay after the interaction: what ripeness and a signal's half-life go by
        click.echo(f"  {f.ts.isoformat()}Z  {f.kind:<12} {f.value:<6g} {_delay(f.ts - served)}")


def _as_json(spec: RewardSpec, ep, result, ripe: bool) -> dict:
    def events(feedback: tuple) -> list[dict]:
        return [
            {"kind": f.kind, "value": f.value, "ts": f.ts.isoformat(), "delay_s": (f.ts - ep.ts).total_seconds()}
            for f in feedback
        ]

    out = {
        "request_id": ep.request_id,
        "policy_version": ep.policy_version,
        "spec": spec.version,
        "ripe": ripe,
        "value": result.value,
        "components": result.components,
        "ignored_kinds": list(result.ignored_kinds),
        "feedback": events(ep.feedback),
    }
    if ep.episode_id is not None:
        out.update(episode_id=ep.episode_id, calls_after=ep.calls_after, outcome=events(ep.outcome))
    return out


def _delay(delta: timedelta) -> str:
    """'40 s after', '39.9 min after', '2.5 h after' (or 'before', for an event stamped earlier)."""
    seconds = abs(delta.total_seconds())
    if seconds < 120:
        amount = f"{seconds:.0f} s"
    else:
        amount = f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"
    return f"{amount} {'after' if delta >= timedelta(0) else 'before'}"


@reward.command()
@click.option(
    "--spec", "spec_path", required=True, type=click.Path(dir_okay=False), help="The new reward spec TOML to compare."
)
@click.option(
    "--against",
    "against_path",
    type=click.Path(dir_okay=False),
    help="The spec to compare with (default: the active one).",
)
@click.option("--top", default=10, show_default=True, help="How many of the biggest movers to list.")
@pass_ctx
def diff(ctx: Context, spec_path: str, against_path: str | None, top: int) -> None:
    """Show how rewards would change under a new spec, before anyone adopts it: both
    distributions, per-signal contributions, how many episodes change sign, the biggest movers.
    Writes nothing."""
    old, new = reward_spec(ctx, against_path), reward_spec(ctx, spec_path)
    d = diff_specs(ctx.engine(), old, new, top=top)
    if d.new.n == 0:
        click.echo("no ripe episodes to compare")
        return
    click.echo(f"{d.new.n} ripe episodes: {d.old_version} -> {d.new_version}")
    click.echo(f"  {'':<8}{'mean':>9}{'std':>8}{'min':>8}{'p10':>8}{'p50':>8}{'p90':>8}{'max':>8}")
    for label, dist in (("old", d.old), ("new", d.new)):
        q = [dist.quantile(x) for x in (0.1, 0.5, 0.9)]
        click.echo(
            f"  {label:<8}{dist.mean:>+9.3f}{dist.std:>8.3f}{dist.min:>+8.2f}"
            + "".join(f"{v:>+8.2f}" for v in q)
            + f"{dist.max:>+8.2f}"
        )
    click.echo("mean contribution per episode:")
    for name, (o, n) in sorted(d.contributions.items()):
        click.echo(f"  {name:<24}{o / d.new.n:>+9.4f} -> {n / d.new.n:>+9.4f}")
    click.echo(f"changed: {d.changed} episodes; sign changed: {d.sign_changes}")
    click.echo("biggest movers:")
    for delta, request_id, o, n in sorted(d.movers, reverse=True):
        if delta > 0:
            click.echo(f"  {request_id:<36}{o:>+8.3f} -> {n:>+8.3f}   (`rtrl reward explain {request_id} --spec ...`)")


@reward.command()
@click.option(
    "--spec", "spec_path", type=click.Path(dir_okay=False), help="Reward spec TOML to apply (default: the active one)."
)
@WORKERS_OPTION
@pass_ctx
def recompute(ctx: Context, spec_path: str | None, workers: int) -> None:
    """Re-apply a spec to all stored history: every ripe episode is scored again and stored
    under the spec's version (other versions' rewards are kept). To adopt it, point
    `reward.spec` in the config at the file."""
    spec = reward_spec(ctx, spec_path)
    with _progress() as on_progress:
        report = run_rewards(ctx.engine(), spec, on_progress=on_progress, force=True, workers=workers)
    click.echo(report.summary())


@reward.command()
@SPEC_OPTION
@pass_ctx
def audit(ctx: Context, spec_path: str | None) -> None:
    """Per policy version, the production canary rates the gate uses: abstention, mean output
    length, tool-error rate, accept rate, follow-up rate."""
    spec = reward_spec(ctx, spec_path)
    per_version = audit_canaries(ctx.engine(), spec)
    if not per_version:
        click.echo("no episodes stored")
        return
    click.echo(f"{'policy':<12}{'episodes':>9}{'abstain':>9}{'length':>9}{'tool err':>9}{'accept':>9}{'followup':>9}")
    for version, c in sorted(per_version.items()):
        r = c.rates()
        click.echo(
            f"{version:<12}{c.episodes:>9}{r['abstention_rate']:>9.1%}{r['mean_length']:>9.0f}"
            f"{r['tool_error_rate']:>9.1%}{r['accept_rate']:>9.1%}{r['followup_rate']:>9.1%}"
        )


@reward.group()
def model() -> None:
    """The outcome model the gate scores fresh answers with (train/outcome.py): a value head on
    the policy's base, fitted on the training slice's rewards, calibrated and checked on tasks it
    never saw. It never replaces real outcomes as the training reward."""


def _print_outcome_model(m: dict, gate: GateConfig) -> None:
    q, w = m["quality"], m["window"]
    click.echo(f"outcome model {m['path']}")
    click.echo(f"  fitted     {m.get('fitted_at', '?')} in {m['seconds']:.0f} s on {m['base_model']}")
    click.echo(
        f"  data       spec {w.get('spec_version', '?')}, rewards {w.get('from_reward_id', '?')}.."
        f"{w.get('to_reward_id', '?')}, served {w.get('served_from', '?')} .. {w.get('served_to', '?')}"
    )
    click.echo(
        "  episodes   "
        + ", ".join(f"{k} {v}" for k, v in m["episodes"].items())
        + " (split by task: the check slice's tasks were never fitted on)"
    )
    click.echo(
        f"  check      AUROC {q['auroc']:.3f}, Brier {q['brier']:.4f} (predicting the mean: "
        f"{q['brier_baseline']:.4f}), calibration error {q['calibration_error']:.3f}, R2 {q['r2']:.3f} "
        f"on {q['episodes']} episodes"
    )
    click.echo(f"  judged     {'usable' if m['usable'] else 'unusable'}: {m['why']}")
    click.echo(f"  gate       {gate_use(m['usable'], gate.estimator, gate.fresh_prompts, gate.fallback)}")


@model.command("show")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (the model's manifest).")
@pass_ctx
def model_show(ctx: Context, as_json: bool) -> None:
    """The newest outcome model: when and on which data it was fitted, its figures on the
    check slice (AUROC, Brier against predicting the mean, calibration error, R2), and whether
    the gate uses it and why (not)."""
    try:
        found = latest_outcome_model(ctx.config.state_dir)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if found is None:
        raise click.ClickException(
            f"no outcome model under {ctx.config.state_dir / 'outcome'}: a cycle fits one once "
            f"{ctx.config.outcome.min_episodes} rewarded episodes are stored (outcome.min_episodes), "
            "or run `rtrl reward model fit`"
        )
    if as_json:
        click.echo(json.dumps({k: v for k, v in found.items() if k != "calibration"}, indent=2))
        return
    _print_outcome_model(found, ctx.config.gate)


@model.command("fit")
@SPEC_OPTION
@pass_ctx
def model_fit(ctx: Context, spec_path: str | None) -> None:
    """Fit the outcome model now on the training slice's latest rewards (as a cycle does when
    `outcome.refresh_episodes` new ones have arrived) and show it; it is recorded in MLflow."""
    found = outcome_model(ctx, reward_spec(ctx, spec_path).version, force=True)
    manifest = getattr(found, "manifest", None)
    if manifest is None:
        raise click.ClickException(f"no outcome model: it {found.why}")
    _print_outcome_model(manifest, ctx.config.gate)
