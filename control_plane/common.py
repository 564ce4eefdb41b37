"""Small helpers every domain service of the control plane uses."""

from __future__ import annotations

from typing import Any

import msgspec
from advanced_alchemy.exceptions import IntegrityError as RepositoryIntegrityError
from msgspec import UNSET
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tokenmill.errors import APIError

# Per-key and per-plan rate limits, in the columns' names.
LIMITS = ("requests_per_minute", "tokens_per_minute", "request_burst", "token_burst", "max_concurrent")


def not_found(kind: str, ref: str) -> APIError:
    return APIError(404, f"No {kind} '{ref}'.", code="not_found")


async def flush_unique(session: AsyncSession, message: str, param: str) -> None:
    """Flush, turning a unique-constraint race into the same 409 the pre-check gives."""
    try:
        await session.flush()
    except (IntegrityError, RepositoryIntegrityError):
        raise APIError(409, message, param=param, code="conflict") from None


def check_limits(values: dict[str, Any]) -> None:
    """A burst needs the rate it bursts (per-minute limits alone are valid)."""
    for burst, rate in (("request_burst", "requests_per_minute"), ("token_burst", "tokens_per_minute")):
        if values.get(burst) is not None and values.get(rate) is None:
            raise APIError(400, f"{burst} needs {rate} to be set.", param=burst)


def changes(data: msgspec.Struct) -> dict[str, Any]:
    """The fields an update body sets (UNSET ones left out)."""
    return {f: v for f in data.__struct_fields__ if (v := getattr(data, f)) is not UNSET}
