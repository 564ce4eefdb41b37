"""stripe sync state

What has been mirrored to Stripe (invoices in `invoices` mode, meter events in `meters`
mode), the webhook events already handled, invoice payment states and the suspensions
that a failed payment caused.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 06:05:00
"""

from collections.abc import Sequence

import advanced_alchemy.types
import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC_TIME = advanced_alchemy.types.datetime.DateTimeUTC(timezone=True)


def upgrade() -> None:
    op.create_table(
        "stripe_invoice_syncs",
        sa.Column("invoice_id", sa.String(length=40), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("stripe_invoice_id", sa.String(length=255), nullable=True),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("stripe_total", sa.BigInteger(), nullable=True),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.Column("finalized_at", UTC_TIME, nullable=True),
        sa.Column("paid_at", UTC_TIME, nullable=True),
        sa.ForeignKeyConstraint(
            ["invoice_id"],
            ["invoices.id"],
            name=op.f("fk_stripe_invoice_syncs_invoice_id_invoices"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("invoice_id", name=op.f("pk_stripe_invoice_syncs")),
        sa.UniqueConstraint("stripe_invoice_id", name=op.f("uq_stripe_invoice_syncs_stripe_invoice_id")),
    )
    with op.batch_alter_table("stripe_invoice_syncs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_stripe_invoice_syncs_org_id"), ["org_id"], unique=False)

    op.create_table(
        "stripe_meter_events",
        sa.Column("identifier", sa.String(length=100), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("hour", UTC_TIME, nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("meter", sa.String(length=20), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("event_name", sa.String(length=100), nullable=False),
        sa.Column("stripe_customer_id", sa.String(length=255), nullable=False),
        sa.Column("value", sa.Numeric(precision=24, scale=6), nullable=False),
        sa.Column("status", sa.String(length=10), nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.Column("sent_at", UTC_TIME, nullable=True),
        sa.PrimaryKeyConstraint("identifier", name=op.f("pk_stripe_meter_events")),
        sa.UniqueConstraint(
            "org_id", "hour", "model", "meter", "seq", name=op.f("uq_stripe_meter_events_org_id")
        ),
    )
    with op.batch_alter_table("stripe_meter_events", schema=None) as batch_op:
        batch_op.create_index("ix_stripe_meter_events_status", ["status"], unique=False)

    op.create_table(
        "stripe_webhook_events",
        sa.Column("id", sa.String(length=255), nullable=False),
        sa.Column("type", sa.String(length=100), nullable=False),
        sa.Column("outcome", sa.String(length=500), nullable=False),
        sa.Column("received_at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stripe_webhook_events")),
    )
    op.create_table(
        "stripe_invoice_payments",
        sa.Column("stripe_invoice_id", sa.String(length=255), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("status", sa.String(length=10), nullable=False),
        sa.Column("failed_at", UTC_TIME, nullable=True),
        sa.Column("paid_at", UTC_TIME, nullable=True),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organizations.id"],
            name=op.f("fk_stripe_invoice_payments_org_id_organizations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("stripe_invoice_id", name=op.f("pk_stripe_invoice_payments")),
    )
    with op.batch_alter_table("stripe_invoice_payments", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_stripe_invoice_payments_org_id"), ["org_id"], unique=False)

    op.create_table(
        "stripe_suspensions",
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("stripe_invoice_id", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organizations.id"],
            name=op.f("fk_stripe_suspensions_org_id_organizations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("org_id", name=op.f("pk_stripe_suspensions")),
    )


def downgrade() -> None:
    op.drop_table("stripe_suspensions")
    with op.batch_alter_table("stripe_invoice_payments", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_stripe_invoice_payments_org_id"))
    op.drop_table("stripe_invoice_payments")
    op.drop_table("stripe_webhook_events")
    with op.batch_alter_table("stripe_meter_events", schema=None) as batch_op:
        batch_op.drop_index("ix_stripe_meter_events_status")
    op.drop_table("stripe_meter_events")
    with op.batch_alter_table("stripe_invoice_syncs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_stripe_invoice_syncs_org_id"))
    op.drop_table("stripe_invoice_syncs")
