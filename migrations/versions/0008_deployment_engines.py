"""deployment engines, GPUs per replica, GPUs per worker lifetime

A deployment gets an `engine` (`builtin`, or `vllm` for what ours cannot serve yet), vLLM's
`engine_args` and `gpus_per_replica`, which becomes the one place a worker's GPU count is
read from: until now it was computed from `config.resources.gpus` (1 by default, 0 without a
GPU type), and that key moves into the column. Worker lifetimes get `gpus`, the count a worker
held, by which its GPU-hours are multiplied; lifetimes recorded before were billed as one GPU
each, so they keep 1 and recomputed rollups of past hours do not change.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26 09:00:00
"""

import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

DEPLOYMENTS = sa.table(
    "deployments",
    sa.column("id", sa.String()),
    sa.column("gpu_type", sa.String()),
    sa.column("config", sa.JSON()),
    sa.column("engine", sa.String()),
    sa.column("engine_args", sa.JSON()),
    sa.column("gpus_per_replica", sa.Integer()),
)


def _config(value: Any) -> dict[str, Any]:
    # A JSON column reads back as a dict through the JSON type; older drivers may hand a str.
    if isinstance(value, str):
        value = json.loads(value)
    return dict(value) if isinstance(value, dict) else {}


def _old_rule(gpu_type: str | None, config: dict[str, Any]) -> int:
    """What `gpus_per_replica()` computed before this revision (0007's code)."""
    if gpu_type is None:
        return 0
    resources = config.get("resources")
    gpus = resources.get("gpus", 1) if isinstance(resources, dict) else 1
    return int(gpus) if isinstance(gpus, int | str) and str(gpus).isdigit() and int(gpus) > 0 else 1


def upgrade() -> None:
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("engine", sa.String(length=20), nullable=True))
        batch_op.add_column(sa.Column("engine_args", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("gpus_per_replica", sa.Integer(), nullable=True))
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("gpus", sa.Integer(), nullable=True))

    conn = op.get_bind()
    rows = conn.execute(sa.select(DEPLOYMENTS.c.id, DEPLOYMENTS.c.gpu_type, DEPLOYMENTS.c.config)).all()
    for dep_id, gpu_type, raw in rows:
        config = _config(raw)
        values: dict[str, Any] = {
            "engine": "builtin",
            "engine_args": {},
            "gpus_per_replica": _old_rule(gpu_type, config),
        }
        resources = config.get("resources")
        if isinstance(resources, dict) and "gpus" in resources:
            # The column is the truth from now on: the key it came from goes.
            rest = {k: v for k, v in resources.items() if k != "gpus"}
            config = {k: v for k, v in config.items() if k != "resources"} | (
                {"resources": rest} if rest else {}
            )
            values["config"] = config if config else sa.null()
        conn.execute(DEPLOYMENTS.update().where(DEPLOYMENTS.c.id == dep_id).values(**values))
    conn.execute(sa.text("UPDATE workers SET gpus = 1"))

    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.alter_column("engine", existing_type=sa.String(length=20), nullable=False)
        batch_op.alter_column("engine_args", existing_type=sa.JSON(), nullable=False)
        batch_op.alter_column("gpus_per_replica", existing_type=sa.Integer(), nullable=False)
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.alter_column("gpus", existing_type=sa.Integer(), nullable=False)


def downgrade() -> None:
    conn = op.get_bind()
    rows = conn.execute(
        sa.select(
            DEPLOYMENTS.c.id, DEPLOYMENTS.c.gpu_type, DEPLOYMENTS.c.config, DEPLOYMENTS.c.gpus_per_replica
        )
    ).all()
    for dep_id, gpu_type, raw, gpus in rows:
        # Back where 0007 reads it; 1 was its default, so only other counts need writing.
        if gpu_type is not None and gpus and gpus != 1:
            config = _config(raw)
            config["resources"] = {**(config.get("resources") or {}), "gpus": gpus}
            conn.execute(DEPLOYMENTS.update().where(DEPLOYMENTS.c.id == dep_id).values(config=config))

    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("gpus")
    with op.batch_alter_table("deployments", schema=None) as batch_op:
        batch_op.drop_column("gpus_per_replica")
        batch_op.drop_column("engine_args")
        batch_op.drop_column("engine")
