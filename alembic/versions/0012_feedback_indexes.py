"""Feedback without two indexes no query needs, each a B-tree write per stored feedback event:
ix_feedback_request_id (ix_feedback_request_kind starts with request_id and serves every lookup
by it) and ix_feedback_kind (every query that names a kind also names the request or episode).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 12:15:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("feedback", schema=None) as batch_op:
        batch_op.drop_index("ix_feedback_request_id")
        batch_op.drop_index("ix_feedback_kind")


def downgrade() -> None:
    with op.batch_alter_table("feedback", schema=None) as batch_op:
        batch_op.create_index("ix_feedback_kind", ["kind"], unique=False)
        batch_op.create_index("ix_feedback_request_id", ["request_id"], unique=False)
