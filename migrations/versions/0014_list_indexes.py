"""list indexes: an organisation's audit entries newest first, its API keys by creation

The dashboard's and the admin API's lists page by keyset (control_plane/paging.py): an
organisation admin's audit log reads its organisation's entries by descending id, which the
index on (org_id, at) cannot give in order, and an organisation's keys are read by (created_at,
id), which the index on org_id alone cannot; so every page sorted all of them.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-15 09:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index("ix_audit_log_org_newest", ["org_id", "id"], unique=False)
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index("ix_api_keys_org_created", ["org_id", "created_at", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index("ix_api_keys_org_created")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index("ix_audit_log_org_newest")
