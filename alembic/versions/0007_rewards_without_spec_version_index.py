"""rewards: no index on spec_version. Training's watermark (spec_version = ? AND id > ?) reads
the rowid range past the last watermark, which holds little else than the current spec's
rewards; a reward is found by (request_id, spec_version), the unique index. Every reward
written paid for it (~1 us of ~5 us per upsert at 300k rewards, more as the index grows).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 00:10:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rewards_spec_version"))


def downgrade() -> None:
    with op.batch_alter_table("rewards", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rewards_spec_version"), ["spec_version"], unique=False)
