"""reward_progress: how far each rule-based spec's reward runs have settled the history, so that a
run reads only what is new (reward/stage.py); reward_waiting: the feedback those runs read whose
interaction had not arrived, so that orphans are counted from it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 15:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "reward_progress",
        sa.Column("spec_version", sa.String(length=128), nullable=False),
        sa.Column("settled_below", sa.BigInteger(), nullable=False),
        sa.Column("feedback_seen", sa.BigInteger(), nullable=False),
        sa.Column("episodes", sa.BigInteger(), nullable=False),
        sa.Column("duplicates", sa.BigInteger(), nullable=False),
        sa.Column("unusable", sa.BigInteger(), nullable=False),
        sa.Column("pending", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("spec_version", name=op.f("pk_reward_progress")),
    )
    op.create_table(
        "reward_waiting",
        sa.Column("spec_version", sa.String(length=128), nullable=False),
        sa.Column("feedback_id", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("spec_version", "feedback_id", name=op.f("pk_reward_waiting")),
    )


def downgrade() -> None:
    op.drop_table("reward_waiting")
    op.drop_table("reward_progress")
