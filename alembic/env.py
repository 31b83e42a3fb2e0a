"""Alembic environment: the target schema is pipeline.core.store.tables.metadata."""

import os

from alembic import context

from pipeline.core.store.db import make_engine
from pipeline.core.store.tables import metadata

config = context.config
url = os.environ.get("RTRL_DB_URL") if config.config_file_name else None
url = url or config.get_main_option("sqlalchemy.url")


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(url)
    with engine.connect() as connection:
        # batch mode lets later migrations ALTER tables on SQLite too
        context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
