"""interactions: what the policy wrote, beside the body -- output_text (the assistant's text),
output_tool_calls (its tool calls as a JSON array, NULL when none) and expects_attempt (from
the metadata). Ingest fills them from the event it has already parsed; a reward run reads them
instead of parsing every body, whose prompt it never needs (a production prompt is most of the
body). Existing rows are filled here from their bodies, 5,000 at a time.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 00:40:00
"""

from collections.abc import Sequence

import orjson
import sqlalchemy as sa
from alembic import op

from pipeline.core.store.events import output_columns

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_BATCH = 5000


def _fill_from_bodies(conn: sa.Connection) -> None:
    stored = sa.table("interactions", sa.column("id"), sa.column("body"))
    update = sa.text(
        "UPDATE interactions SET output_text = :output_text, output_tool_calls = :output_tool_calls, "
        "expects_attempt = :expects_attempt WHERE id = :id"
    )
    last = 0
    while True:
        rows = conn.execute(
            sa.select(stored.c.id, stored.c.body).where(stored.c.id > last).order_by(stored.c.id).limit(_BATCH)
        ).all()
        if not rows:
            return
        params = []
        for id_, body in rows:
            event = orjson.loads(body)  # stored bodies passed the contract at ingest: JSON objects
            params.append({"id": id_, **output_columns(event.get("completion"), event.get("metadata"))})
        conn.execute(update, params)
        last = rows[-1][0]


def upgrade() -> None:
    with op.batch_alter_table("interactions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("output_text", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("output_tool_calls", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("expects_attempt", sa.Boolean(), nullable=True))
    _fill_from_bodies(op.get_bind())
    with op.batch_alter_table("interactions", schema=None) as batch_op:
        batch_op.alter_column("output_text", existing_type=sa.Text(), nullable=False)
        batch_op.alter_column("expects_attempt", existing_type=sa.Boolean(), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("interactions", schema=None) as batch_op:
        batch_op.drop_column("expects_attempt")
        batch_op.drop_column("output_tool_calls")
        batch_op.drop_column("output_text")
