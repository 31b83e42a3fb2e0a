"""`rtrl reward`: compute rewards from stored outcomes, and look inside them."""

from __future__ import annotations

import json

import click

from pipeline.cli.common import CONTEXT_SETTINGS, Context, pass_ctx
from reward.spec import RewardSpec, SpecError, load_spec
from reward.stage import explain as explain_episode
from reward.stage import run_rewards

SPEC_OPTION = click.option(
    "--spec", "spec_path", type=click.Path(dir_okay=False),
    help="Reward spec TOML (default: reward.spec from the config, else the spec shipped with rtrl).",
)


def _spec(ctx: Context, path: str | None) -> RewardSpec:
    try:
        return load_spec(path or ctx.config.reward.spec)
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None


@click.group(context_settings=CONTEXT_SETTINGS)
def reward() -> None:
    """Turn delayed outcomes (accepted, edited, reverted, ...) into one reward per episode.

    A reward spec (TOML) says how each feedback kind counts, when an outcome is final
    (ripeness) and which outputs are penalised whatever users said (guards).
    """


@reward.command()
@SPEC_OPTION
@pass_ctx
def run(ctx: Context, spec_path: str | None) -> None:
    """Compute rewards for ripe episodes; update those with late feedback. Incremental and
    idempotent: running it twice changes nothing."""
    spec = _spec(ctx, spec_path)
    report = run_rewards(ctx.engine(), spec)
    click.echo(report.summary())
    if report.ignored_kinds:
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted(report.ignored_kinds.items()))
        click.echo(f"feedback kinds the spec does not weigh (add them to count them): {kinds}")


@reward.command()
@click.argument("request_id")
@SPEC_OPTION
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def explain(ctx: Context, request_id: str, spec_path: str | None, as_json: bool) -> None:
    """Print an episode, its feedback and every component of its reward."""
    spec = _spec(ctx, spec_path)
    found = explain_episode(ctx.engine(), spec, request_id)
    if found is None:
        raise click.ClickException(f"no interaction with request_id {request_id!r} is stored")
    ep, result, ripe = found
    if as_json:
        click.echo(json.dumps({
            "request_id": ep.request_id, "policy_version": ep.policy_version, "spec": spec.version,
            "ripe": ripe, "value": result.value, "components": result.components,
            "ignored_kinds": list(result.ignored_kinds),
            "feedback": [{"kind": f.kind, "value": f.value, "ts": f.ts.isoformat()} for f in ep.feedback],
        }, indent=2))
        return
    text = ep.text if len(ep.text) <= 300 else ep.text[:300] + f"... ({len(ep.text)} chars)"
    click.echo(f"episode {ep.request_id}  policy {ep.policy_version}  at {ep.ts.isoformat()}Z")
    click.echo(f"output: {text!r}" + (f"  [{len(ep.tool_calls)} tool calls]" if ep.tool_calls else ""))
    click.echo("feedback:" + ("" if ep.feedback else " none"))
    for f in sorted(ep.feedback, key=lambda f: (f.ts, f.event_id)):
        click.echo(f"  {f.ts.isoformat()}Z  {f.kind:<12} {f.value:g}")
    click.echo(f"reward under {spec.version}" + ("" if ripe else " (not ripe yet: may still change)") + ":")
    for name, value in result.components.items():
        click.echo(f"  {name:<22} {value:+.4f}")
    if result.ignored_kinds:
        click.echo(f"  (ignored kinds: {', '.join(result.ignored_kinds)})")
    clipped = "" if result.value == result.unclipped else f"  (clipped from {result.unclipped:+.4f})"
    click.echo(f"  {'= reward':<22} {result.value:+.4f}{clipped}")
