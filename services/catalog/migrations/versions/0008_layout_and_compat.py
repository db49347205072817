"""builds of their own: the published files' layout (farm | hf) and the older-runtime graph target (IR 10 / opset 20)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.add_column(sa.Column("layout", sa.String(8), nullable=False, server_default="farm"))
        batch.add_column(sa.Column("compat", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.drop_column("compat")
        batch.drop_column("layout")
