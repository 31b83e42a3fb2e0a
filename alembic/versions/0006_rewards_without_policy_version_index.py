"""rewards: no index on policy_version. No query needs it (per-version figures group whole
scans, a canary's window goes through interactions.ts), SQLite's planner picked it for the
canary's online check (reading every reward the champion ever had), and every reward written
paid for it (~1.4 us of ~8 us per upsert)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 22:45:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rewards_policy_version"))


def downgrade() -> None:
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rewards_policy_version"), ["policy_version"], unique=False)
