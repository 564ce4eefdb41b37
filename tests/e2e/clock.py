"""Keeping end-to-end billing journeys inside one calendar month."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta


def wait_out_month_end(margin: timedelta = timedelta(minutes=10)) -> None:
    """If the month ends within `margin`, sleep until it has: a journey's usage then lands
    on one monthly invoice. Costs at most `margin`, at most once a month."""
    now = datetime.now(UTC)
    first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    following = (
        first.replace(year=first.year + 1, month=1)
        if first.month == 12
        else first.replace(month=first.month + 1)
    )
    if following - now < margin:
        time.sleep((following - now).total_seconds() + 1)
