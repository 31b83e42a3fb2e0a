"""`rtrl gate`, `rtrl models`, `rtrl promote`, `rtrl rollback`: the registry side of the loop.

Every alias move is recorded in the store (who, when, from, to, why) and announced on the
model-updates topic; `promote` refuses a version without a passing gate decision unless a
human forces it with a reason.
"""

from __future__ import annotations

import getpass
import json
from contextlib import contextmanager

import click

from pipeline.cli.common import CONTEXT_SETTINGS, Context, kafka_failure, outcome_model, pass_ctx
from pipeline.cli.reward import SPEC_OPTION, reward_spec
from pipeline.core.store.deploys import latest_decision, moves
from pipeline.core.store.training import get_run, latest_finished_run

GATE_REFUSED = 3  # `rtrl gate`'s exit code when the decision is FAILED (1: an error, nothing decided)

# deploy.* imports mlflow (seconds): imported inside the commands, never at `rtrl --help`


@contextmanager
def _registry(ctx: Context):
    from deploy.registry import Registry, RegistryError
    from deploy.serving.events import ModelUpdatePublisher

    config = ctx.config
    publisher = ModelUpdatePublisher(config.kafka_access, config.kafka.model_updates_topic)
    try:
        registry = Registry(config.tracking_uri, config.mlflow.registered_model, ctx.engine(), publisher)
        for line in registry.repair():
            click.echo(f"repaired: {line}", err=True)
        yield registry
    except RegistryError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        publisher.close()


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("run_id", required=False)
@click.option("--promote", is_flag=True, help="Move `champion` to the candidate if the gate passes.")
@click.option("--suite", type=click.Path(dir_okay=False), help="Regression suite TOML (gate.suite).")
@SPEC_OPTION
@pass_ctx
def gate(ctx: Context, run_id: str | None, promote: bool, suite: str | None, spec_path: str | None) -> None:
    """Register a training run's adapter as a candidate and gate it against the champion.

    Evaluates both on the held-out slice (the improvement by gate.estimator: fresh answers
    scored by the outcome model, fitted first if enough new rewards arrived; importance sampling
    and the doubly robust estimate beside it), the regression suite, canaries, KL and a
    load-and-generate check; stores the decision with every number and tags it on the model
    version. RUN_ID defaults to the latest finished run.

    Exit code: 0 passed, 3 refused (the decision is stored either way; a CI job can branch on
    it), 1 an error (nothing decided).
    """
    from deploy.stage import GateJob, gate_run
    from deploy.suite import EMPTY, SuiteError, load_suite
    from train.inference import PolicySet
    from train.models import ModelError

    config = ctx.config
    spec = reward_spec(ctx, spec_path)
    run = get_run(ctx.engine(), run_id) if run_id else latest_finished_run(ctx.engine())
    if run is None:
        raise click.ClickException(
            f"no training run {run_id}" if run_id else "no finished training run to gate: `rtrl train run` first"
        )
    try:
        suite_path = suite or config.gate.suite
        suite_obj = load_suite(suite_path) if suite_path else EMPTY
        runner = PolicySet.load(config.train.base_model or run.base_model, device=config.train.torch_device)
    except (SuiteError, ModelError) as exc:
        raise click.ClickException(str(exc)) from None
    from reward.analysis import audit

    production = {version: c.rates() for version, c in audit(ctx.engine(), spec).items()}
    outcome = outcome_model(ctx, spec.version)
    with _registry(ctx) as registry:
        job = GateJob(
            ctx.engine(),
            registry,
            runner,
            run.run_id,
            spec.version,
            config.train,
            config.gate,
            suite=suite_obj,
            abstention_patterns=spec.guards.abstention.patterns,
            promote=promote,
            production_canaries=production,
            outcome=outcome,
        )
        result = gate_run(job)
    d, ev = result.decision, result.evaluation
    against = f"champion v{result.champion.version}" if result.champion else "the base model (first deployment)"
    click.echo(
        f"candidate v{result.version.version} (run {run.run_id}) against {against}: "
        f"{'PASSED' if d.passed else 'FAILED'}"
    )
    click.echo(f"  outcome model: {'usable' if outcome.usable else 'not used'}: {outcome.why}")
    click.echo(
        f"  improvement by {ev.comparison.estimator}: {ev.comparison.improvement.value:+.4f} "
        f"[{ev.comparison.improvement.low:+.4f}, {ev.comparison.improvement.high:+.4f}]"
        + (f" ({ev.comparison.note})" if ev.comparison.note else "")
    )
    click.echo(
        f"  reward (importance sampling, {ev.episodes} held-out episodes): candidate "
        f"{ev.candidate.reward.value:.4f} [{ev.candidate.reward.low:.4f}, {ev.candidate.reward.high:.4f}], "
        f"{ev.champion.version} {ev.champion.reward.value:.4f}"
    )
    for c in d.checks:
        mark = "-" if not c.applicable else ("ok" if c.passed else "FAIL")
        click.echo(f"  [{mark:>4}] {c.name}: {c.detail}")
    if result.promoted:
        click.echo(f"promoted v{result.version.version} to champion")
    elif promote and d.passed:
        click.echo(f"v{result.version.version} already is the champion")
    if not d.passed:
        click.get_current_context().exit(GATE_REFUSED)


@click.group(context_settings=CONTEXT_SETTINGS)
def models() -> None:
    """Model versions in the registry: aliases, gate decisions, the audit trail."""


@models.command("list")
@pass_ctx
def list_cmd(ctx: Context) -> None:
    """Every version with its aliases, training run and gate outcome."""
    with _registry(ctx) as registry:
        versions = registry.list()
        if not versions:
            click.echo(f"no versions of {registry.name} yet: `rtrl train run`, then `rtrl gate`")
        for v in versions:
            decision = latest_decision(ctx.engine(), registry.name, v.version)
            outcome = (
                "gate: no decision"
                if decision is None
                else (f"{decision.stage}: {'passed' if decision.passed else 'failed'}")
            )
            click.echo(
                f"v{v.version:<4} {','.join(v.aliases) or '-':<28} run {v.tags.get('rtrl.run_id', '?')}  {outcome}"
            )


@models.command()
@click.argument("version")
@pass_ctx
def show(ctx: Context, version: str) -> None:
    """One version: source, tags, the gate decision with every number, alias moves."""
    with _registry(ctx) as registry:
        v = registry.get(version)
        click.echo(f"v{v.version}  aliases {', '.join(v.aliases) or '-'}  source {v.source}")
        for key, value in sorted(v.tags.items()):
            click.echo(f"  {key} = {value}")
        decision = latest_decision(ctx.engine(), registry.name, v.version)
        if decision is not None:
            click.echo(
                f"gate decision {decision.id} ({decision.decided_at:%Y-%m-%d %H:%M:%S} UTC): "
                f"{'passed' if decision.passed else 'failed'} against "
                f"{('v' + decision.champion_version) if decision.champion_version else 'no champion'}"
            )
            click.echo(json.dumps(decision.report, indent=2, default=str))
        for m in moves(ctx.engine(), registry.name):
            if version in (m.to_version, m.from_version):
                click.echo(
                    f"  {m.at:%Y-%m-%d %H:%M:%S} {m.alias}: {m.from_version} -> {m.to_version} by {m.actor} "
                    f"({m.status}): {m.reason}"
                )


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("version")
@click.option("--force", is_flag=True, help="Promote without a passing gate decision (needs --reason).")
@click.option("--reason", default="", help="Why; recorded in the audit trail.")
@click.option("--actor", default=getpass.getuser, show_default="the current user", help="Who decides.")
@pass_ctx
def promote(ctx: Context, version: str, force: bool, reason: str, actor: str) -> None:
    """Make VERSION the champion (the old one becomes `previous`); serving follows."""
    with _registry(ctx) as registry:
        moved = registry.promote(version, actor=actor, reason=reason, force=force)
    click.echo(f"v{version} is the champion" + ("" if moved else " already: nothing moved"))


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--to", "to_version", help="Version to restore (default: the `previous` alias).")
@click.option(
    "--canary",
    is_flag=True,
    help="Withdraw the canary of a staged rollout instead: every request "
    "goes to the champion, and the daemon's cycle records the candidate as rejected.",
)
@click.option(
    "--force",
    is_flag=True,
    help="With --to: restore a version that was never the champion and has no "
    "passing decision (needs a --reason of your own).",
)
@click.option("--reason", help='Why; recorded in the audit trail (default "rollback"; --force needs one of yours).')
@click.option("--actor", default=getpass.getuser, show_default="the current user", help="Who decides.")
@pass_ctx
def rollback(ctx: Context, to_version: str | None, canary: bool, force: bool, reason: str | None, actor: str) -> None:
    """Move `champion` back to the previous version (or --to VERSION); serving follows.

    \b
    Rollbacks walk back through the promotions: after v1 -> v2 -> v3, a rollback serves v2 and
    a second one v1 (never v3 again); `previous` is then the version the restored one replaced.
    The version rolled back is not promoted again by the daemon (a cycle that had decided to
    promote it records it as rejected); `rtrl promote VERSION --force --reason ...` does.
    A promotion that failed half way leaves `previous` as it was, so the target stays right.
    --to a version that was never the champion is a promotion: it needs a passing gate decision,
    or --force.

    With --canary, withdraw a staged candidate instead (to promote it early: `rtrl promote VERSION`)."""
    if force and not (reason or "").strip():
        raise click.UsageError("--force needs --reason: say why the gate is overridden")
    reason = reason or "rollback"
    with _registry(ctx) as registry:
        if canary:
            withdrawn = registry.unstage(actor=actor, reason=reason)
            click.echo(
                f"withdrew canary v{withdrawn.version}: the champion serves every request"
                if withdrawn
                else "no canary to withdraw"
            )
            return
        target = registry.rollback(actor=actor, reason=reason, to=to_version, force=force)
    click.echo(f"rolled back: v{target.version} is the champion")


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True)
@click.option(
    "--base-model",
    type=click.Path(file_okay=False),
    help="Base model directory (default: train.base_model, else the champion's base_model tag).",
)
@click.option("--tenant", default="default", show_default=True, help="Tenant of requests without X-Tenant.")
@click.option("--no-events", is_flag=True, help="Do not send interaction events to Kafka.")
@click.option(
    "--vllm",
    "vllm_url",
    help="Do not serve: keep the vLLM server at this URL on the champion adapter (and a canary's).",
)
@pass_ctx
def serve(
    ctx: Context, host: str, port: int, base_model: str | None, tenant: str, no_events: bool, vllm_url: str | None
) -> None:
    """Serve the champion (OpenAI-compatible /v1/completions and /v1/chat/completions) and
    follow the registry: a promotion or rollback swaps the adapter without a restart. During a
    staged rollout (`[rollout] share`) the canary answers its share of requests. With --vllm,
    the canary's adapter is loaded on vLLM next to the champion's; the router in front of vLLM
    sends it its share."""
    from deploy.serving.start import FollowFailed, ServeJob, StartError, keep_vllm, serve_policy

    job = ServeJob(
        ctx.config, _load_policy, host=host, port=port, base_model=base_model, tenant=tenant, events=not no_events
    )
    try:
        if vllm_url:
            keep_vllm(job, vllm_url)
        else:
            serve_policy(job)
    except StartError as exc:
        raise click.ClickException(str(exc)) from None
    except FollowFailed as exc:
        raise kafka_failure(ctx.config, exc.cause, exc.doing) from None


def _load_policy(base: str):  # train.inference.PolicySet, for deploy.serving, which imports no model code
    from deploy.serving.start import StartError
    from train.inference import PolicySet
    from train.models import ModelError

    try:
        return PolicySet.load(base)
    except ModelError as exc:
        raise StartError(str(exc)) from None


COMMANDS = [gate, models, promote, rollback, serve]
