"""request and live keys (one live export per request), token expiry, use and revocation

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

LIVE = ("QUEUED", "RUNNING", "READY")


def upgrade() -> None:
    with op.batch_alter_table("exports") as batch:
        batch.add_column(sa.Column("request_key", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("live_key", sa.String(length=64), nullable=True))
    exports = sa.table("exports", sa.column("id", sa.String), sa.column("cache_key", sa.String),
                       sa.column("request_key", sa.String), sa.column("live_key", sa.String),
                       sa.column("status", sa.String), sa.column("created_at", sa.DateTime))
    conn = op.get_bind()
    conn.execute(exports.update().values(request_key=exports.c.cache_key))
    # The newest live export of each key keeps deduplicating; older duplicates (made before this
    # constraint, by concurrent requests) stop.
    seen = set()
    rows = conn.execute(sa.select(exports.c.id, exports.c.cache_key).where(exports.c.status.in_(LIVE))
                        .order_by(exports.c.created_at.desc())).all()
    for row in rows:
        if row.cache_key not in seen:
            seen.add(row.cache_key)
            conn.execute(exports.update().where(exports.c.id == row.id).values(live_key=row.cache_key))
    with op.batch_alter_table("exports") as batch:
        batch.alter_column("request_key", existing_type=sa.String(length=64), nullable=False)
        batch.create_index("ix_exports_request_key", ["request_key"])
        batch.create_unique_constraint("uq_exports_live_key", ["live_key"])
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("bootstrap", sa.Boolean(), nullable=False, server_default=sa.false()))
    tokens = sa.table("api_tokens", sa.column("name", sa.String), sa.column("bootstrap", sa.Boolean))
    conn.execute(tokens.update().where(tokens.c.name == "bootstrap-admin").values(bootstrap=True))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("bootstrap")
        batch.drop_column("revoked_at")
        batch.drop_column("last_used_at")
        batch.drop_column("expires_at")
    with op.batch_alter_table("exports") as batch:
        batch.drop_constraint("uq_exports_live_key", type_="unique")
        batch.drop_index("ix_exports_request_key")
        batch.drop_column("live_key")
        batch.drop_column("request_key")
