"""An app with the admin API (and the gateway, to see keys stop working), on a migrated
database of either kind, served for real on the test's loop; and tiny PEFT adapters."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar import Litestar

from billing.models import Price
from control_plane.bootstrap import bootstrap
from tests import databases
from tests.gateway.conftest import serve
from tokenmill.app import Parts, create_app
from tokenmill.db import make_engine, make_sessionmaker, utcnow
from tokenmill.settings import BUNDLED_MODEL, Settings
from tokenmill.storage import Storage

MODEL = "SmolLM2-135M-Instruct"
SECRET_KEY = "test-secret"
# A GPU type in the price book from the start: dedicated deployments need a priced one.
GPU = "L4"

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads and 3 KV heads of 64, 30 layers.
SMOL = {"hidden": 576, "intermediate": 1536, "q": 576, "kv": 192, "layers": 30}


@dataclass
class Org:
    id: str
    admin_key: str  # an org_admin key of it

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"}


@dataclass
class AdminEnv:
    client: httpx.AsyncClient
    app: Litestar
    root_key: str  # the bootstrap platform-admin key, of the default organisation
    default_org: str
    settings: Settings

    @property
    def root(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.root_key}"}

    @property
    def storage(self) -> Storage:
        return self.app.state.storage

    async def org(self, name: str) -> Org:
        """A new organisation (made by the platform admin) and an org_admin key of it."""
        r = await self.client.post("/admin/v1/organizations", headers=self.root, json={"name": name})
        assert r.status_code == 201, r.text
        org_id = r.json()["id"]
        r = await self.client.post(
            f"/admin/v1/organizations/{org_id}/keys", headers=self.root, json={"role": "org_admin"}
        )
        assert r.status_code == 201, r.text
        return Org(org_id, r.json()["secret"])

    async def member_key(self, org_id: str, **body: Any) -> dict[str, Any]:
        r = await self.client.post(
            f"/admin/v1/organizations/{org_id}/keys", headers=self.root, json={"role": "member", **body}
        )
        assert r.status_code == 201, r.text
        return dict(r.json())

    async def upload(
        self,
        org_id: str,
        headers: dict[str, str],
        files: dict[str, bytes],
        *,
        name: str = "my-lora",
        model: str = MODEL,
    ) -> httpx.Response:
        """POST an adapter as `curl -F file=@adapter_config.json -F file=@...` would."""
        parts = [
            ("file", (filename, content, "application/octet-stream")) for filename, content in files.items()
        ]
        return await self.client.post(
            f"/admin/v1/organizations/{org_id}/adapters",
            headers=headers,
            data={"name": name, "model": model},
            files=parts,
        )

    async def audit(self, headers: dict[str, str] | None = None, **params: Any) -> list[dict[str, Any]]:
        r = await self.client.get("/admin/v1/audit", headers=headers or self.root, params=params)
        assert r.status_code == 200, r.text
        return list(r.json()["data"])


@contextlib.asynccontextmanager
async def make_admin_env(
    tmp_path: Path, model_cache: Path, db_url: str, **overrides: Any
) -> AsyncIterator[AdminEnv]:
    """The app on a freshly migrated and bootstrapped database; `overrides` are settings."""
    settings = Settings(
        home=tmp_path,
        database_url=db_url,
        internal_token="internal-test-token",
        secret_key=SECRET_KEY,
        model_cache=model_cache,
        worker_wait_seconds=1.0,
        **overrides,
    )
    await asyncio.to_thread(databases.migrate, settings.db_url)
    engine = make_engine(settings.db_url)
    boot = await bootstrap(
        make_sessionmaker(engine),
        secret_key=SECRET_KEY,
        model_name=MODEL,
        model_source=BUNDLED_MODEL,
        model_format="gguf",
        context_length=8192,
    )
    assert boot.admin_secret
    async with make_sessionmaker(engine)() as session, session.begin():
        session.add(
            Price(gpu_type=GPU, gpu_hour=Decimal("0.80"), effective_from=utcnow() - timedelta(days=1))
        )
    app = create_app(settings, engine, Parts(gateway=True, admin=True, internal_bus=True))
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        yield AdminEnv(client, app, boot.admin_secret, boot.org.id, settings)


@pytest.fixture
async def admin_env(tmp_path: Path, model_cache: Path, db_url: str) -> AsyncIterator[AdminEnv]:
    async with make_admin_env(tmp_path, model_cache, db_url) as env:
        yield env


# --- PEFT adapters -------------------------------------------------------------------------


def lora_files(
    *,
    rank: int = 4,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    layers: int = SMOL["layers"],
    shapes: dict[str, tuple[int, int]] | None = None,
    config: dict[str, Any] | None = None,
    extra: dict[str, Sequence[int]] | None = None,
    seed: int = 0,
) -> dict[str, bytes]:
    """A random LoRA adapter as PEFT saves it (tensor names, config keys), for SmolLM2's
    shapes unless `shapes` overrides a module's (in, out)."""
    import torch
    from safetensors.torch import save

    dims = {
        "q_proj": (SMOL["hidden"], SMOL["q"]),
        "k_proj": (SMOL["hidden"], SMOL["kv"]),
        "v_proj": (SMOL["hidden"], SMOL["kv"]),
        "o_proj": (SMOL["q"], SMOL["hidden"]),
        "gate_proj": (SMOL["hidden"], SMOL["intermediate"]),
        "up_proj": (SMOL["hidden"], SMOL["intermediate"]),
        "down_proj": (SMOL["intermediate"], SMOL["hidden"]),
    } | (shapes or {})
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in targets:
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            n_in, n_out = dims[module]
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.zeros(n_out, rank)
    for name, shape in (extra or {}).items():
        tensors[name] = torch.zeros(*shape)
    cfg = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.05,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_dora": False,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    } | (config or {})
    return {
        "adapter_config.json": json.dumps(cfg).encode(),
        "adapter_model.safetensors": save(tensors, metadata={"format": "pt"}),
    }


@pytest.fixture(scope="session")
def good_adapter() -> dict[str, bytes]:
    return lora_files()
