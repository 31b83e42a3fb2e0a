"""alias_moves.kind: what a move was -- promote, rollback, stage or withdraw. A rollback goes
back through the promotions (the version before the restored one becomes `previous`), and a
version rolled back is not promoted again without --force; both read the kind. Rows written
before this revision have none and count as promotions (they were, or canary moves).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 05:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("alias_moves", schema=None) as batch_op:
        batch_op.add_column(sa.Column("kind", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("alias_moves", schema=None) as batch_op:
        batch_op.drop_column("kind")
