"""placement: the worker class (queue) a job was sent to, from its resource estimate, and what each
worker reports it has

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.add_column(sa.Column("queue", sa.String(40), nullable=True))
        batch.add_column(sa.Column("estimate", sa.JSON(), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("capacity", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("gpu_device", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("gpu_device")
        batch.drop_column("capacity")
    with op.batch_alter_table("exports") as batch:
        batch.drop_column("estimate")
        batch.drop_column("queue")
