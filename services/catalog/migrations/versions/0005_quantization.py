"""weight-only quantized exports: the quantization options of a request

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.add_column(sa.Column("quant", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.drop_column("quant")
