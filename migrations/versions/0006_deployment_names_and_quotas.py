"""deployment names per organisation, plan quotas

Deployment names become unique per organisation (so no tenant learns another's from a
conflict), serverless ones among themselves through a partial unique index (NULLs are
distinct to a unique constraint, on SQLite as on PostgreSQL); plans get quotas on dedicated
replicas and GPUs. Names were unique across everything before, so existing rows satisfy both.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SERVERLESS = sa.text("org_id IS NULL")


def upgrade() -> None:
    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.add_column(sa.Column("max_dedicated_replicas", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_gpus", sa.Integer(), nullable=True))

    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_deployments_name"), type_="unique")
        batch_op.create_unique_constraint(batch_op.f("uq_deployments_org_id"), ["org_id", "name"])
    op.create_index(
        "uq_deployments_serverless_name",
        "deployments",
        ["name"],
        unique=True,
        sqlite_where=SERVERLESS,
        postgresql_where=SERVERLESS,
    )


def downgrade() -> None:
    op.drop_index("uq_deployments_serverless_name", table_name="deployments")
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_deployments_org_id"), type_="unique")
        batch_op.create_unique_constraint(batch_op.f("uq_deployments_name"), ["name"])

    with op.batch_alter_table("plans", schema=None) as batch_op:
        batch_op.drop_column("max_gpus")
        batch_op.drop_column("max_dedicated_replicas")
