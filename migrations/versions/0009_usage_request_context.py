"""each request's context on its usage event

Usage events get the OpenAI `user` the request named (the caller's end user), the caller's
`X-Client-Request-Id`, and the `service_tier` it ran at (`default`, or `flex`: batch
priority). Events recorded before had no tier to choose: they ran as `default`, and say so.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("user", sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column("client_request_id", sa.String(length=512), nullable=True))
        # The server default fills the rows there are, and keeps writers that predate the
        # column (the previous release's ledger consumer, mid-rollout) inserting.
        batch_op.add_column(
            sa.Column("service_tier", sa.String(length=10), server_default="default", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.drop_column("service_tier")
        batch_op.drop_column("client_request_id")
        batch_op.drop_column("user")
