"""Agent episodes: interactions.episode_id and step (the calls of one task, NULL: a call that is
its own episode), feedback.episode_id (an outcome of a whole episode; feedback names exactly one
of request_id and episode_id, so request_id becomes nullable), rewards.outcome and
training_episodes.outcome (which episode outcome a call's reward credited, and what a training
run used). Interactions stored with an `episode_id` in their body (contract v1 had the field
before the column) get it here.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 17:30:00
"""

from collections.abc import Sequence

import orjson
import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BATCH = 5000


def _fill_from_bodies(conn: sa.Connection) -> None:
    stored = sa.table("interactions", sa.column("id"), sa.column("body"))
    update = sa.text("UPDATE interactions SET episode_id = :episode_id, step = :step WHERE id = :id")
    last = 0
    while True:
        rows = conn.execute(
            sa.select(stored.c.id, stored.c.body)
            .where(stored.c.id > last, stored.c.body.contains('"episode_id"'))
            .order_by(stored.c.id)
            .limit(_BATCH)
        ).all()
        if not rows:
            return
        params = []
        for id_, body in rows:
            event = orjson.loads(body)
            episode, step = event.get("episode_id"), event.get("step")
            if isinstance(episode, str) and episode:
                params.append(
                    {
                        "id": id_,
                        "episode_id": episode[:256],
                        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
                    }
                )
        if params:
            conn.execute(update, params)
        last = rows[-1][0]


def upgrade() -> None:
    with op.batch_alter_table("interactions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("episode_id", sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column("step", sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f("ix_interactions_episode_id"), ["episode_id"], unique=False)
    with op.batch_alter_table("feedback", schema=None) as batch_op:
        batch_op.add_column(sa.Column("episode_id", sa.String(length=256), nullable=True))
        batch_op.alter_column("request_id", existing_type=sa.String(length=256), nullable=True)
        batch_op.create_index(batch_op.f("ix_feedback_episode_id"), ["episode_id"], unique=False)
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.add_column(sa.Column("outcome", sa.JSON(), nullable=True))
    with op.batch_alter_table("training_episodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("outcome", sa.JSON(), nullable=True))
    _fill_from_bodies(op.get_bind())


def downgrade() -> None:
    outcomes = op.get_bind().scalar(sa.text("SELECT count(*) FROM feedback WHERE request_id IS NULL"))
    if outcomes:
        raise RuntimeError(
            f"{outcomes} feedback events name an episode, not a request: revision 0010 cannot "
            "hold them (export the store with `rtrl export` first, then delete them)"
        )
    with op.batch_alter_table("training_episodes", schema=None) as batch_op:
        batch_op.drop_column("outcome")
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.drop_column("outcome")
    with op.batch_alter_table("feedback", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_feedback_episode_id"))
        batch_op.alter_column("request_id", existing_type=sa.String(length=256), nullable=False)
        batch_op.drop_column("episode_id")
    with op.batch_alter_table("interactions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_interactions_episode_id"))
        batch_op.drop_column("step")
        batch_op.drop_column("episode_id")
