"""What the catalogue's rules need from outside the control plane, handed over by the
composition root (tokenmill/app.py) to every front door alike."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncSession

from control_plane.policy import QuotaDefaults
from tokenmill.settings import Settings
from tokenmill.storage import Storage

# Whether a GPU type has a price in effect now. The price book is billing's, and billing
# builds on the control plane (never the other way round), so the composition root passes
# billing's lookup in; it reads through the caller's session, inside the same transaction.
GpuPriced = Callable[[AsyncSession, str], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class CatalogConfig:
    gpu_priced: GpuPriced
    settings: Settings
    storage: Storage | None = None  # adapter files (None: this process takes no uploads)

    @property
    def cache_dir(self) -> Path:
        """Where base models are resolved to check adapters against."""
        return self.settings.cache_dir

    @property
    def max_lora_rank(self) -> int:
        return self.settings.max_lora_rank

    @property
    def quotas(self) -> QuotaDefaults:
        return QuotaDefaults(
            max_dedicated_replicas=self.settings.default_max_dedicated_replicas,
            max_gpus=self.settings.default_max_gpus,
        )
