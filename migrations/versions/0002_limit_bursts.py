"""rate-limit bursts and per-key concurrency

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 05:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("request_burst", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("token_burst", sa.Integer(), nullable=True))
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("request_burst", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("token_burst", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_concurrent", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("max_concurrent")
        batch.drop_column("token_burst")
        batch.drop_column("request_burst")
    with op.batch_alter_table("plans") as batch:
        batch.drop_column("token_burst")
        batch.drop_column("request_burst")
