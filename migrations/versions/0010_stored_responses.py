"""stored responses of /v1/responses

Responses created with `store` (OpenAI's default) are kept per organisation: the Response
object as answered and the conversation it answered, so `GET /v1/responses/{id}`,
`input_items` and `previous_response_id` can read them back until they expire
(`TOKENMILL_RESPONSE_RETENTION_DAYS`); the `purge_responses` job deletes expired ones.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 09:00:00
"""

from collections.abc import Sequence

import advanced_alchemy.types
import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("org_id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("created_at", advanced_alchemy.types.datetime.DateTimeUTC(timezone=True), nullable=False),
        sa.Column("expires_at", advanced_alchemy.types.datetime.DateTimeUTC(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["org_id"],
            ["organizations.id"],
            name=op.f("fk_stored_responses_org_id_organizations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stored_responses")),
    )
    with op.batch_alter_table("stored_responses", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_stored_responses_org_id"), ["org_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_stored_responses_expires_at"), ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("stored_responses", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_stored_responses_expires_at"))
        batch_op.drop_index(batch_op.f("ix_stored_responses_org_id"))
    op.drop_table("stored_responses")
