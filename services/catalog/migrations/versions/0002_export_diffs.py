"""export diffs and regression flags (re-exports on runtime upgrades)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.add_column(sa.Column("diff", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("regression", sa.Boolean(), nullable=False, server_default=sa.false()))
        batch.create_index("ix_exports_predecessor_id", ["predecessor_id"])


def downgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.drop_index("ix_exports_predecessor_id")
        batch.drop_column("regression")
        batch.drop_column("diff")
