"""billing rollups and invoices

Hourly usage rollups, invoices and their lines; price versions unique per subject and
moment (and exactly one subject each); the ledger indexed by time for rollups and exports.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 06:05:00
"""

from collections.abc import Sequence

import advanced_alchemy.types
import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC_TIME = advanced_alchemy.types.datetime.DateTimeUTC(timezone=True)
SERIAL = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "invoices",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("number", sa.Integer(), nullable=True),
        sa.Column("period_start", UTC_TIME, nullable=False),
        sa.Column("period_end", UTC_TIME, nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("subtotal", sa.Numeric(precision=18, scale=2), nullable=False),
        sa.Column("total", sa.Numeric(precision=18, scale=2), nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.Column("updated_at", UTC_TIME, nullable=False),
        sa.Column("finalized_at", UTC_TIME, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoices")),
        sa.UniqueConstraint("number", name=op.f("uq_invoices_number")),
        sa.UniqueConstraint("org_id", "period_start", "currency", name=op.f("uq_invoices_org_id")),
    )
    op.create_table(
        "usage_rollups",
        sa.Column("id", SERIAL, nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("hour", UTC_TIME, nullable=False),
        sa.Column("deployment_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("adapter", sa.String(length=200), nullable=False),
        sa.Column("meter", sa.String(length=20), nullable=False),
        sa.Column("price_id", sa.String(length=40), nullable=False),
        sa.Column("quantity", sa.Numeric(precision=24, scale=6), nullable=False),
        sa.Column("unit_price", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("amount", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("currency", sa.String(length=3), nullable=False),
        sa.Column("computed_at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_rollups")),
        sa.UniqueConstraint(
            "org_id",
            "hour",
            "deployment_id",
            "model",
            "adapter",
            "meter",
            "price_id",
            name=op.f("uq_usage_rollups_org_id"),
        ),
    )
    with op.batch_alter_table("usage_rollups") as batch_op:
        batch_op.create_index("ix_usage_rollups_hour", ["hour"], unique=False)

    op.create_table(
        "invoice_lines",
        sa.Column("id", SERIAL, nullable=False),
        sa.Column("invoice_id", sa.String(length=40), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("description", sa.String(length=500), nullable=False),
        sa.Column("meter", sa.String(length=20), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("deployment_id", sa.String(length=40), nullable=False),
        sa.Column("adapter", sa.String(length=200), nullable=False),
        sa.Column("quantity", sa.Numeric(precision=24, scale=6), nullable=False),
        sa.Column("unit_price", sa.Numeric(precision=18, scale=9), nullable=False),
        sa.Column("amount", sa.Numeric(precision=18, scale=2), nullable=False),
        sa.ForeignKeyConstraint(
            ["invoice_id"],
            ["invoices.id"],
            name=op.f("fk_invoice_lines_invoice_id_invoices"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoice_lines")),
    )
    with op.batch_alter_table("invoice_lines") as batch_op:
        batch_op.create_index(batch_op.f("ix_invoice_lines_invoice_id"), ["invoice_id"], unique=False)

    with op.batch_alter_table("prices") as batch_op:
        batch_op.create_unique_constraint(batch_op.f("uq_prices_gpu_type"), ["gpu_type", "effective_from"])
        batch_op.create_unique_constraint(batch_op.f("uq_prices_model_id"), ["model_id", "effective_from"])
        batch_op.create_check_constraint(
            batch_op.f("ck_prices_one_subject"), "(model_id IS NULL) <> (gpu_type IS NULL)"
        )

    with op.batch_alter_table("usage_events") as batch_op:
        batch_op.create_index("ix_usage_events_created_at", ["created_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("usage_events") as batch_op:
        batch_op.drop_index("ix_usage_events_created_at")

    with op.batch_alter_table("prices") as batch_op:
        batch_op.drop_constraint(batch_op.f("ck_prices_one_subject"), type_="check")
        batch_op.drop_constraint(batch_op.f("uq_prices_model_id"), type_="unique")
        batch_op.drop_constraint(batch_op.f("uq_prices_gpu_type"), type_="unique")

    with op.batch_alter_table("invoice_lines") as batch_op:
        batch_op.drop_index(batch_op.f("ix_invoice_lines_invoice_id"))
    op.drop_table("invoice_lines")
    with op.batch_alter_table("usage_rollups") as batch_op:
        batch_op.drop_index("ix_usage_rollups_hour")
    op.drop_table("usage_rollups")
    op.drop_table("invoices")
