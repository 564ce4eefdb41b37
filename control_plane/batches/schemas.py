"""A batch's row as OpenAI's Batch object, as the SDK reads it."""

from __future__ import annotations

from datetime import datetime

import msgspec

from control_plane.batches.models import Batch
from tokenmill.openai_batches import (
    BatchError,
    BatchErrors,
    BatchObject,
    BatchRequestCounts,
    BatchUsage,
    InputTokensDetails,
    OutputTokensDetails,
)


def _seconds(t: datetime | None) -> int | None:
    return None if t is None else int(t.timestamp())


def batch_object(row: Batch) -> BatchObject:
    """The Batch object of OpenAI's API, as the SDK reads it."""
    errors = None
    if row.errors:
        errors = BatchErrors([msgspec.convert(e, BatchError) for e in row.errors])
    return BatchObject(
        id=row.id,
        endpoint=row.endpoint,
        errors=errors,
        input_file_id=row.input_file_id,
        completion_window=row.completion_window,
        status=row.status,  # type: ignore[arg-type]  # the table holds only these statuses
        output_file_id=row.output_file_id,
        error_file_id=row.error_file_id,
        created_at=int(row.created_at.timestamp()),
        in_progress_at=_seconds(row.in_progress_at),
        expires_at=_seconds(row.expires_at),
        finalizing_at=_seconds(row.finalizing_at),
        completed_at=_seconds(row.completed_at),
        failed_at=_seconds(row.failed_at),
        expired_at=_seconds(row.expired_at),
        cancelling_at=_seconds(row.cancelling_at),
        cancelled_at=_seconds(row.cancelled_at),
        request_counts=BatchRequestCounts(row.total, row.completed, row.failed),
        usage=BatchUsage(
            input_tokens=row.input_tokens,
            input_tokens_details=InputTokensDetails(row.cached_tokens),
            output_tokens=row.output_tokens,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=row.input_tokens + row.output_tokens,
        ),
        model=row.model,
        metadata=row.meta,
    )
