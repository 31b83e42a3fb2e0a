"""`rtrl train`: LoRA updates of the policy from rewarded production episodes."""

from __future__ import annotations

import dataclasses
import json
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import get_args

import click
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from pipeline.cli.common import CONTEXT_SETTINGS, Context, pass_ctx
from pipeline.cli.reward import SPEC_OPTION, reward_spec
from pipeline.core.config import TrainConfig
from pipeline.core.store.training import get_run, latest_finished_run, lineage
from pipeline.core.train_config import LossName
from train.models import ModelError
from train.tracking import MemoryTracker

# train.run (torch, peft) and deploy.tracking (mlflow) are imported inside the command that
# needs them: `rtrl --help` and every other command stay fast.


@click.group(context_settings=CONTEXT_SETTINGS)
def train() -> None:
    """Train a LoRA update of the policy on rewarded episodes (CISPO by default).

    Reads the rewards of the current spec created after the parent adapter's data watermark,
    within the staleness budget; every run is an MLflow run with the adapter as an artifact.
    """


@contextmanager
def _progress():
    """A step bar with the last loss and reward on a terminal; a log line per step otherwise."""
    if not sys.stdout.isatty():
        yield lambda step, total, m: click.echo(
            f"step {step}/{total} loss {m['loss']:.4f} reward {m['reward_mean']:.3f} "
            f"kl {m['kl_behavior']:.4f} {m['tokens_per_s']:.0f} tok/s",
            err=True,
        )
        return
    with Progress(
        TextColumn("training"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        transient=True,
    ) as bar:
        task = bar.add_task("", total=None)

        def update(step: int, total: int, m: dict[str, float]) -> None:
            bar.update(
                task,
                completed=step,
                total=total,
                description=f"loss {m['loss']:.4f}  reward {m['reward_mean']:.3f}  {m['tokens_per_s']:.0f} tok/s",
            )

        yield update


def _selection_lines(report) -> list[str]:
    c = report.selection
    versions = ", ".join(f"{v}: {n}" for v, n in sorted(report.by_policy_version.items())) or "none"
    return [
        f"rewards after watermark {report.watermark_from}: {c['candidates']:,}",
        f"  excluded: {c['stale']:,} stale, {c['other_tenant']:,} other tenants, {c.get('other_policy', 0):,} served "
        f"by another model, {c['held_out']:,} held out for the gate, {c['over_limit']:,} over train.max_episodes",
        f"  selected: {c['selected']:,} (served by policy versions {versions}); watermark -> {report.watermark_to}",
    ]


@train.command()
@click.option("--base-model", type=click.Path(file_okay=False), help="Base model directory (train.base_model).")
@click.option(
    "--adapter",
    type=click.Path(file_okay=False),
    help="Continue this adapter (the champion's); its rtrl_run.json gives the data watermark.",
)
@click.option("--since", type=int, help="Read rewards after this reward id instead of the adapter's watermark.")
@click.option("--loss", type=click.Choice(get_args(LossName)), help="train.loss")
@click.option("--epochs", type=int, help="train.epochs")
@click.option("--max-steps", type=int, help="train.max_steps")
@click.option("--learning-rate", type=float, help="train.learning_rate")
@click.option("--tenant", help="Only this tenant's episodes (train.tenant).")
@click.option(
    "--nproc",
    type=click.IntRange(1, 64),
    help="train.nproc: data-parallel processes (torch.distributed.run; gloo on CPU, NCCL on GPUs).",
)
@click.option(
    "--strategy",
    type=click.Choice(["ddp", "fsdp"]),
    help="train.strategy: with --nproc > 1, a whole base model per process (ddp) or its weights "
    "split over them (fsdp).",
)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), help="train.device")
@click.option("--dry-run", is_flag=True, help="Print the data selection only; load and write nothing.")
@SPEC_OPTION
@pass_ctx
def run(
    ctx: Context,
    base_model: str | None,
    adapter: str | None,
    since: int | None,
    dry_run: bool,
    spec_path: str | None,
    **overrides,
) -> None:
    """Run one training: select episodes, train, save the adapter, record the MLflow run."""
    from train.run import NothingToTrain, Parent, TrainJob, run_training

    updates = {k: v for k, v in overrides.items() if v is not None}
    if base_model:
        updates["base_model"] = Path(base_model)
    try:
        cfg = TrainConfig.model_validate({**ctx.config.train.model_dump(), **updates})
        parent = Parent.from_adapter(adapter) if adapter else None
    except (ValueError, ModelError) as exc:
        raise click.ClickException(str(exc)) from None
    spec = reward_spec(ctx, spec_path)
    engine = ctx.engine()
    if dry_run:
        report = run_training(TrainJob(engine, cfg, spec.version, Path(), MemoryTracker(), parent, since, dry_run=True))
        click.echo("\n".join(_selection_lines(report)))
        return
    from deploy.tracking import MlflowTracker
    from pipeline.core.logs import redacted_uri

    config = ctx.config
    tracker = MlflowTracker(config.tracking_uri, config.mlflow.experiment, config.artifact_root)
    try:
        with _progress() as on_step:
            job = TrainJob(
                engine,
                cfg,
                spec.version,
                config.state_dir / "runs",
                tracker,
                parent,
                since,
                params={"tracking_uri": redacted_uri(config.tracking_uri)},
                on_step=on_step,
            )
            report = run_training(job)
    except (NothingToTrain, ModelError) as exc:
        tracker.end("FAILED")
        raise click.ClickException(str(exc)) from None
    click.echo("\n".join(_selection_lines(report)))
    skipped = {**report.data.skipped, "too_long": report.too_long, "unreadable": report.unreadable}
    click.echo(
        f"trained {report.loop.steps} steps on {report.data.episodes:,} episodes "
        f"({report.loop.tokens:,} tokens, {report.loop.tokens / max(report.loop.seconds, 1e-9):,.0f} tok/s); "
        f"skipped {', '.join(f'{k} {v}' for k, v in skipped.items() if v) or 'none'}; "
        f"behaviour log-probs {json.dumps(report.data.behavior)}"
    )
    click.echo(
        f"run {report.run_id}  adapter {report.adapter}  mlflow run {tracker.run_id} "
        f"({redacted_uri(config.tracking_uri)})"
    )


@train.command()
@click.argument("run_id", required=False)
@click.option("--episodes", "show_episodes", is_flag=True, help="List the episodes the run trained on.")
@pass_ctx
def show(ctx: Context, run_id: str | None, show_episodes: bool) -> None:
    """Show a training run (default: the latest finished one): window, adapter, outcome."""
    engine = ctx.engine()
    row = get_run(engine, run_id) if run_id else latest_finished_run(engine)
    if row is None:
        raise click.ClickException(
            f"no training run {run_id or '(finished)'} in the store; start one with `rtrl train run`"
        )
    for key, value in dataclasses.asdict(row).items():
        click.echo(f"{key}: {json.dumps(value, default=str) if isinstance(value, dict) else value}")
    if show_episodes:
        for request_id, reward, outcome in lineage(engine, row.run_id):
            # a call of an agent episode: which episode outcome (its events) the reward credited
            credited = (
                f"\tepisode {outcome['episode_id']} outcome {','.join(outcome['events']) or 'none'} "
                f"x {outcome['credit']:.3g}"
                if outcome
                else ""
            )
            click.echo(f"  {request_id}\t{reward:+.4f}{credited}")
