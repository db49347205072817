"""the request's graph builder: auto | hand | traced (transformers.exporters, exporter/graph/traced.py)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.add_column(sa.Column("builder", sa.String(8), nullable=False, server_default="auto"))


def downgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.drop_column("builder")
