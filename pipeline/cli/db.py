"""`rtrl db`: schema migrations (alembic under the hood, no ini file needed)."""

from __future__ import annotations

import click

from pipeline.cli.common import CONTEXT_SETTINGS, Context, pass_ctx
from pipeline.core.store import db as store_db


@click.group(context_settings=CONTEXT_SETTINGS)
def db() -> None:
    """Create or migrate the store's schema (SQLite by default, PostgreSQL by URL)."""


@db.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@pass_ctx
def upgrade(ctx: Context, revision: str) -> None:
    """Migrate the store to the newest schema (creates it when empty). Safe to re-run."""
    url = ctx.config.db_url
    store_db.upgrade(url, revision)
    click.echo(
        f"store {ctx.engine(check_schema=False).url.render_as_string(hide_password=True)} "
        f"is at revision {store_db.current_revision(ctx.engine(check_schema=False))}"
    )


@db.command()
@click.argument("revision")
@pass_ctx
def downgrade(ctx: Context, revision: str) -> None:
    """Migrate the store down to REVISION ("base" drops everything rtrl created)."""
    store_db.downgrade(ctx.config.db_url, revision)
    click.echo(f"store is at revision {store_db.current_revision(ctx.engine(check_schema=False))}")


@db.command()
@pass_ctx
def current(ctx: Context) -> None:
    """Print the store's revision and the one this code needs."""
    cur = store_db.current_revision(ctx.engine(check_schema=False))
    head = store_db.head_revision()
    click.echo(
        f"current: {cur or '(empty)'}\nhead:    {head}\n"
        + ("up to date" if cur == head else "behind: run `rtrl db upgrade`")
    )
