"""refusals: refused requests per organisation, API key, reason and minute

Requests refused before any worker ran them (401/403/404/429, bad requests), counted by the
gateways in memory and added here every few seconds: one row per organisation, key, reason
and UTC minute (billing/refusals).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-08 09:00:00
"""

from collections.abc import Sequence

import advanced_alchemy.types
import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "refusals",
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("minute", advanced_alchemy.types.datetime.DateTimeUTC(timezone=True), nullable=False),
        sa.Column("api_key_id", sa.String(length=40), nullable=False),
        sa.Column("reason", sa.String(length=40), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("org_id", "minute", "api_key_id", "reason", name=op.f("pk_refusals")),
    )
    with op.batch_alter_table("refusals", schema=None) as batch_op:
        batch_op.create_index("ix_refusals_minute", ["minute"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("refusals", schema=None) as batch_op:
        batch_op.drop_index("ix_refusals_minute")
    op.drop_table("refusals")
