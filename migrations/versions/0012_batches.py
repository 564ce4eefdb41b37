"""batches of /v1/batches, and the batch discount in the ledger and the price book

An organisation's batches (a row each) and their input lines (a row per line, the request
until it runs, then its result), owned by control_plane/batches; the usage ledger names the
batch a request ran in, and each price version carries the batch discount (a fraction of the
token prices, 0.5 by default).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 09:00:00
"""

from collections.abc import Sequence

import advanced_alchemy.types
import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

WHEN = advanced_alchemy.types.datetime.DateTimeUTC(timezone=True)


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("api_key_id", sa.String(length=40), nullable=True),
        sa.Column("endpoint", sa.String(length=40), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=8), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("queued_tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", WHEN, nullable=False),
        sa.Column("expires_at", WHEN, nullable=False),
        sa.Column("in_progress_at", WHEN, nullable=True),
        sa.Column("finalizing_at", WHEN, nullable=True),
        sa.Column("completed_at", WHEN, nullable=True),
        sa.Column("failed_at", WHEN, nullable=True),
        sa.Column("expired_at", WHEN, nullable=True),
        sa.Column("cancelling_at", WHEN, nullable=True),
        sa.Column("cancelled_at", WHEN, nullable=True),
        sa.Column("lease_owner", sa.String(length=64), nullable=True),
        sa.Column("lease_until", WHEN, nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"], ["organizations.id"], name=op.f("fk_batches_org_id_organizations"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_batches")),
    )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_batches_org_id"), ["org_id"], unique=False)
        batch_op.create_index("ix_batches_status", ["status"], unique=False)
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("line", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=True),
        sa.Column("state", sa.String(length=8), nullable=False),
        sa.Column("body", sa.Text(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"], ["batches.id"], name=op.f("fk_batch_lines_batch_id_batches"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("batch_id", "line", name=op.f("pk_batch_lines")),
    )
    with op.batch_alter_table("batch_lines", schema=None) as batch_op:
        batch_op.create_index("ix_batch_lines_state", ["batch_id", "state", "line"], unique=False)
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("batch_id", sa.String(length=64), nullable=True))
    with op.batch_alter_table("prices", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "batch_discount", sa.Numeric(precision=5, scale=4), server_default="0.5", nullable=False
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("prices", schema=None) as batch_op:
        batch_op.drop_column("batch_discount")
    with op.batch_alter_table("usage_events", schema=None) as batch_op:
        batch_op.drop_column("batch_id")
    with op.batch_alter_table("batch_lines", schema=None) as batch_op:
        batch_op.drop_index("ix_batch_lines_state")
    op.drop_table("batch_lines")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_status")
        batch_op.drop_index(batch_op.f("ix_batches_org_id"))
    op.drop_table("batches")
