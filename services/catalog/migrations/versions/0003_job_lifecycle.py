"""job lifecycle: outbox dispatch time, lease owner's process, re-export target runtime, lost attempts

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.add_column(sa.Column("worker_pid", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("target_ort", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("lost_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("lost_attempts", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("dispatched_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_unique_constraint("uq_exports_successor", ["predecessor_id", "target_ort"])


def downgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.drop_constraint("uq_exports_successor", type_="unique")
        batch.drop_column("dispatched_at")
        batch.drop_column("lost_attempts")
        batch.drop_column("lost_reason")
        batch.drop_column("target_ort")
        batch.drop_column("worker_pid")
