"""What the admin API's wire types share (each domain's schemas.py builds on these).

Request bodies refuse unknown fields, so a typo (`request_per_minute`) is a 400 naming it
rather than a setting silently ignored. Update bodies use `UNSET` for "leave as is", so
`null` can mean "clear" (no limit, no plan, no expiry).
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from tokenmill.errors import APIError

Name = Annotated[str, Meta(min_length=1, max_length=200)]
# What clients send as `model` (deployments, adapters, models): no spaces or odd characters.
ModelName = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$")]
# Limits fit the database's 32-bit integer columns.
Limit = Annotated[int, Meta(ge=1, le=2_147_483_647)]

T = TypeVar("T")


class Body(msgspec.Struct, forbid_unknown_fields=True):
    pass


def out(row: Any, kind: type[T]) -> T:
    """A table row as one of the API's answer types."""
    return msgspec.convert(row, kind, from_attributes=True)


def parse(data: dict[str, Any], kind: type[T]) -> T:
    """Form fields or command options as one of the API's bodies, validated as the API
    validates them (a 400 naming what is wrong)."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"Invalid value: {exc}") from None
