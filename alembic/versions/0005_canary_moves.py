"""alias moves of a staged rollout: the `canary` alias is also cleared (no to_version), and a
canary move records the share of traffic it was given

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 04:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("alias_moves", schema=None) as batch_op:
        batch_op.alter_column("to_version", existing_type=sa.String(length=64), nullable=True)
        batch_op.add_column(sa.Column("share", sa.Float(), nullable=True))


def downgrade() -> None:
    # a cleared canary has no to_version: such rows cannot go back to the old schema
    op.execute("DELETE FROM alias_moves WHERE to_version IS NULL")
    with op.batch_alter_table("alias_moves", schema=None) as batch_op:
        batch_op.drop_column("share")
        batch_op.alter_column("to_version", existing_type=sa.String(length=64), nullable=False)
