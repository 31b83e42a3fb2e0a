"""`rtrl dead-letters list|show|replay`: the records ingest set aside, without SQL."""

from __future__ import annotations

import click

from ingest.replay import replay_dead_letters
from pipeline.cli.common import CONTEXT_SETTINGS, Context, pass_ctx
from pipeline.core.store.event_reads import dead_letter, dead_letter_list
from pipeline.core.types import DeadLetterReason

REASONS = [r.value for r in DeadLetterReason]
SHOWN_BYTES = 4096  # of a record's raw bytes by default: an oversized one may be megabytes


@click.group("dead-letters", context_settings=CONTEXT_SETTINGS)
def dead_letters() -> None:
    """Records that could not become events (bad JSON, schema violations, oversized, ...).

    \b
    rtrl dead-letters list [--reason R]   the newest, one line each
    rtrl dead-letters show ID [--all]     one letter: where it was, why, its bytes
    rtrl dead-letters replay [--dry-run]  decode them again after a fix (same as rtrl replay --dead-letters)

    `rtrl status` counts them by reason.
    """


@dead_letters.command("list", context_settings=CONTEXT_SETTINGS)
@click.option("--reason", type=click.Choice(REASONS), help="Only letters set aside for this reason.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000), help="How many, newest first.")
@pass_ctx
def list_cmd(ctx: Context, reason: str | None, limit: int) -> None:
    """The newest dead letters: id, when, reason, where in the log, size, what the decoder said."""
    letters = dead_letter_list(ctx.engine(), reason=reason, limit=limit)
    if not letters:
        click.echo("no dead letters" + (f" of reason {reason}" if reason else ""))
        return
    for d in letters:
        detail = d.detail if len(d.detail) <= 100 else d.detail[:97] + "..."
        click.echo(
            f"{d.id}  {d.created_at:%Y-%m-%d %H:%M:%S}  {d.reason}  {d.source}[{d.partition}]@{d.offset}  "
            f"{d.size} B  {detail}"
        )


@dead_letters.command("show", context_settings=CONTEXT_SETTINGS)
@click.argument("letter_id", type=int)
@click.option("--all", "whole", is_flag=True, help=f"Print every byte (default: the first {SHOWN_BYTES}).")
@pass_ctx
def show(ctx: Context, letter_id: int, whole: bool) -> None:
    """One dead letter: where it was in the log, why it was set aside, and its bytes (as text,
    undecodable bytes escaped)."""
    d = dead_letter(ctx.engine(), letter_id)
    if d is None:
        raise click.ClickException(f"no dead letter {letter_id} (`rtrl dead-letters list` shows the ids)")
    raw = d.raw or b""
    shown = raw if whole else raw[:SHOWN_BYTES]
    click.echo(f"dead letter {d.id}: {d.reason}, set aside {d.created_at:%Y-%m-%d %H:%M:%S} UTC")
    click.echo(f"from:   {d.source} partition {d.partition} offset {d.offset}")
    click.echo(f"detail: {d.detail}")
    click.echo(f"bytes:  {d.size}" + ("" if len(shown) == len(raw) else f" (the first {len(shown)}; --all for all)"))
    click.echo(shown.decode("utf-8", errors="backslashreplace"))


@dead_letters.command("replay", context_settings=CONTEXT_SETTINGS)
@click.option("--dry-run", is_flag=True, help="Decode and compare with the store, write nothing.")
@pass_ctx
def replay(ctx: Context, dry_run: bool) -> None:
    """Decode every dead letter again (after a fix to the producer's schema or to the limits):
    those that now pass are stored, once, and their letters removed; the rest stay."""
    report = replay_dead_letters(ctx.config, ctx.engine(), dry_run=dry_run)
    click.echo(("dry run: " if dry_run else "") + report.summary())


COMMANDS = [dead_letters]
