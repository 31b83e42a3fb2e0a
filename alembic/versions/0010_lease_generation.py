"""leases.generation: a fencing token. Every time the lease changes hands (or is re-taken after
it expired) its generation grows; a daemon's cycle writes its state, and the registry records a
move, only while the lease row still has that daemon as owner, the same generation and an expiry
in the future -- checked in the same transaction, by the database's clock. A daemon whose lease
was taken over stops its cycle at the next step instead of gating and promoting beside the new
holder.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 06:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(sa.Column("generation", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("generation")
