"""Feedback names its tenant: an episode's outcome joins the calls of that tenant's episode only
(two tenants' "task-7" were one episode, each getting the other's outcomes). NULL -- existing
rows, and producers that name none -- matches the episode id in every tenant, as before.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 02:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("feedback", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tenant", sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("feedback", schema=None) as batch_op:
        batch_op.drop_column("tenant")
