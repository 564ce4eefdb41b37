"""LoRA adapter uploads: tiny random PEFT adapters for SmolLM2's shapes (rank 4, q_proj and
v_proj) are checked tensor by tensor against the base model's config.json, stored, listed
and deleted; malformed ones are refused with a 400 naming what is wrong, leaving nothing
behind. Stored on a local directory, and once on S3 (moto's server)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest
from moto.server import ThreadedMotoServer
from sqlalchemy import func, select

from control_plane.audit.models import AuditEntry
from control_plane.catalog.models import Adapter
from tests.control_plane.conftest import GPU, MODEL, SMOL, AdminEnv, lora_files, make_admin_env

API = "/admin/v1"
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
V_B0 = "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"


def error(r: Any, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["param"] == param, body
    return str(body["message"])


async def counts(env: AdminEnv) -> tuple[int, int]:
    async with env.app.state.sessionmaker() as s:
        adapters = await s.scalar(select(func.count()).select_from(Adapter))
        audit = await s.scalar(select(func.count()).where(AuditEntry.resource_type == "adapter"))
    return int(adapters or 0), int(audit or 0)


async def test_upload_list_use_and_delete(admin_env: AdminEnv, good_adapter: dict[str, bytes]) -> None:
    a = await admin_env.org("org-a")
    r = await admin_env.upload(a.id, a.headers, good_adapter, name="support-bot")
    assert r.status_code == 201, r.text
    adapter = r.json()
    assert (adapter["org_id"], adapter["name"], adapter["rank"]) == (a.id, "support-bot", 4)
    assert adapter["target_modules"] == ["q_proj", "v_proj"]
    assert adapter["sha256"] == hashlib.sha256(good_adapter[WEIGHTS]).hexdigest()
    assert adapter["size_bytes"] == len(good_adapter[WEIGHTS]) + len(good_adapter[CONFIG])
    # both files are in storage, byte for byte, under the organisation and the adapter
    prefix = f"adapters/{a.id}/{adapter['id']}/"
    storage = admin_env.storage
    assert list(storage.list(prefix)) == [prefix + CONFIG, prefix + WEIGHTS]
    assert storage.get(prefix + WEIGHTS) == good_adapter[WEIGHTS]
    assert json.loads(storage.get(prefix + CONFIG))["r"] == 4
    # listed and usable by name by its organisation only
    c = admin_env.client
    assert [
        x["id"] for x in (await c.get(f"{API}/organizations/{a.id}/adapters", headers=a.headers)).json()
    ] == [adapter["id"]]
    assert (await c.get(f"{API}/adapters/{adapter['id']}", headers=a.headers)).json()["name"] == "support-bot"
    key = (await admin_env.member_key(a.id))["secret"]
    served = [
        m["id"]
        for m in (await c.get("/v1/models", headers={"authorization": f"Bearer {key}"})).json()["data"]
    ]
    assert "support-bot" in served
    # same name again: 409; a second organisation may use the name
    error(await admin_env.upload(a.id, a.headers, good_adapter, name="support-bot"), 409, "name")
    b = await admin_env.org("org-b")
    assert (await admin_env.upload(b.id, b.headers, good_adapter, name="support-bot")).status_code == 201
    # delete removes the row and the files
    assert (await c.delete(f"{API}/adapters/{adapter['id']}", headers=a.headers)).status_code == 204
    assert list(storage.list(prefix)) == []
    assert (await c.get(f"{API}/adapters/{adapter['id']}", headers=a.headers)).status_code == 404


async def test_a_wrong_shaped_adapter_is_refused_naming_the_tensor(admin_env: AdminEnv) -> None:
    # v_proj's output is 3 KV heads x 64 = 192; this adapter was made for 9 KV heads (576).
    wrong = lora_files(shapes={"v_proj": (SMOL["hidden"], SMOL["q"])})
    before = await counts(admin_env)
    r = await admin_env.upload(admin_env.default_org, admin_env.root, wrong)
    message = error(r, 400, V_B0)
    assert "[576, 4]" in message and "[192, 4]" in message
    assert r.json()["error"]["code"] == "invalid_adapter"
    # nothing stored, no row, no audit entry
    assert await counts(admin_env) == before
    assert list(admin_env.storage.list("adapters/")) == []


@pytest.mark.parametrize(
    ("files", "param", "says"),
    [
        (
            lambda: lora_files(config={"r": 8}),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "[8, 576]",
        ),
        (lambda: lora_files(config={"target_modules": ["q_proj", "lm_head"]}), "target_modules", "lm_head"),
        (lambda: lora_files(config={"target_modules": "q_proj|v_proj"}), "target_modules", "list"),
        (
            lambda: lora_files(config={"target_modules": ["q_proj"]}),
            "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
            "not in target_modules",
        ),
        (
            lambda: lora_files(layers=31),
            "base_model.model.model.layers.30.self_attn.q_proj.lora_A.weight",
            "30 layers",
        ),
        (
            lambda: lora_files(extra={"base_model.model.model.embed_tokens.lora_A.weight": (4, 49152)}),
            "base_model.model.model.embed_tokens.lora_A.weight",
            "not a LoRA weight",
        ),
        (
            lambda: lora_files(
                targets=["gate_proj"], shapes={"gate_proj": (SMOL["intermediate"], SMOL["hidden"])}
            ),
            "base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight",
            "[4, 576]",
        ),
        (lambda: lora_files(config={"peft_type": "IA3"}), "peft_type", "LoRA"),
        (lambda: lora_files(config={"use_dora": True}), "use_dora", "not supported"),
        (lambda: lora_files(config={"modules_to_save": ["lm_head"]}), "modules_to_save", "not supported"),
        (lambda: lora_files(config={"r": 0}), "r", "positive"),
        (lambda: {CONFIG: b"{not json", WEIGHTS: lora_files()[WEIGHTS]}, CONFIG, "JSON"),
        (lambda: {CONFIG: lora_files()[CONFIG], WEIGHTS: lora_files()[WEIGHTS][:-10]}, WEIGHTS, "truncated"),
        (lambda: {CONFIG: lora_files()[CONFIG], WEIGHTS: b"PK\x03\x04 a zip"}, WEIGHTS, "safetensors"),
        (lambda: {CONFIG: lora_files()[CONFIG]}, WEIGHTS, "missing"),
        (lambda: {WEIGHTS: lora_files()[WEIGHTS]}, CONFIG, "missing"),
        (
            lambda: {CONFIG: lora_files()[CONFIG], "adapter_model.bin": b"\x80\x04pickle"},
            WEIGHTS,
            "runs code",
        ),
    ],
)
async def test_malformed_adapters_are_400(admin_env: AdminEnv, files: Any, param: str, says: str) -> None:
    before = await counts(admin_env)
    message = error(await admin_env.upload(admin_env.default_org, admin_env.root, files()), 400, param)
    assert says in message, message
    assert await counts(admin_env) == before and list(admin_env.storage.list("adapters/")) == []


async def test_all_linear_adapters_larger_than_the_default_body_limit(admin_env: AdminEnv) -> None:
    """Rank 16 on every projection is ~20 MB, twice Litestar's default body limit; PEFT's
    `all-linear` shorthand names all seven modules."""
    files = lora_files(
        rank=16,
        targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        config={"target_modules": "all-linear"},
    )
    assert len(files[WEIGHTS]) > 10 * 2**20
    r = await admin_env.upload(admin_env.default_org, admin_env.root, files, name="big")
    assert r.status_code == 201, r.text
    assert r.json()["rank"] == 16 and len(r.json()["target_modules"]) == 7


def _without_b(files: dict[str, bytes]) -> dict[str, bytes]:
    import safetensors.torch

    tensors = safetensors.torch.load(files[WEIGHTS])
    del tensors[V_B0]
    return {CONFIG: files[CONFIG], WEIGHTS: safetensors.torch.save(tensors)}


async def test_every_lora_a_needs_its_lora_b(admin_env: AdminEnv, good_adapter: dict[str, bytes]) -> None:
    r = await admin_env.upload(admin_env.default_org, admin_env.root, _without_b(good_adapter))
    assert "lora_A but no lora_B" in error(r, 400, V_B0)


async def test_rank_limit(admin_env: AdminEnv, good_adapter: dict[str, bytes]) -> None:
    admin_env.settings.max_lora_rank = 2  # TOKENMILL_MAX_LORA_RANK
    r = await admin_env.upload(admin_env.default_org, admin_env.root, good_adapter)
    assert "exceeds the maximum of 2" in error(r, 400, "r")


async def test_bad_form_fields_and_base_models(admin_env: AdminEnv, good_adapter: dict[str, bytes]) -> None:
    c, h, org = admin_env.client, admin_env.root, admin_env.default_org
    error(await admin_env.upload(org, h, good_adapter, name="bad name"), 400, "name")
    error(await admin_env.upload(org, h, good_adapter, model="no-such-model"), 400, "model")
    # a name a deployment already answers to would be shadowed by it
    error(await admin_env.upload(org, h, good_adapter, name=MODEL), 409, "name")
    # embedding models take no adapters; a model whose files the control plane cannot read is refused
    await c.post(
        f"{API}/models", headers=h, json={"name": "minilm", "source": "bundled:minilm", "kind": "embed"}
    )
    error(await admin_env.upload(org, h, good_adapter, model="minilm"), 400, "model")
    await c.post(f"{API}/models", headers=h, json={"name": "ghost", "source": "/nonexistent/model"})
    assert "cannot be checked" in error(
        await admin_env.upload(org, h, good_adapter, model="ghost"), 400, "model"
    )
    # not multipart at all
    r = await c.post(f"{API}/organizations/{org}/adapters", headers=h, json={"name": "x"})
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
    # files may be named by their field rather than their file name
    r = await c.post(
        f"{API}/organizations/{org}/adapters",
        headers=h,
        data={"name": "by-field", "model": MODEL},
        files=[(CONFIG, ("cfg.json", good_adapter[CONFIG])), (WEIGHTS, ("w.bin", good_adapter[WEIGHTS]))],
    )
    assert r.status_code == 201, r.text


async def test_adapters_are_their_organisations_own(
    admin_env: AdminEnv, good_adapter: dict[str, bytes]
) -> None:
    a, b = await admin_env.org("org-a"), await admin_env.org("org-b")
    c = admin_env.client
    mine = (await admin_env.upload(a.id, a.headers, good_adapter, name="a-lora")).json()
    # B cannot see, list, delete or upload into A's
    assert (await c.get(f"{API}/adapters/{mine['id']}", headers=b.headers)).status_code == 404
    assert (await c.delete(f"{API}/adapters/{mine['id']}", headers=b.headers)).status_code == 404
    assert (await c.get(f"{API}/organizations/{a.id}/adapters", headers=b.headers)).status_code == 404
    assert (await admin_env.upload(a.id, b.headers, good_adapter, name="planted")).status_code == 404
    assert (await c.get(f"{API}/organizations/{b.id}/adapters", headers=b.headers)).json() == []
    # ...nor pin it to its own deployment: it reads as missing
    r = await c.post(
        f"{API}/deployments",
        headers=b.headers,
        json={"name": "b-dep", "model": MODEL, "adapters": [mine["id"]]},
    )
    error(r, 400, "adapters")
    # A pins it to a dedicated deployment; while pinned it cannot be deleted
    r = await c.post(
        f"{API}/deployments",
        headers=a.headers,
        json={"name": "a-dep", "model": MODEL, "gpu_type": GPU, "adapters": [mine["id"]]},
    )
    assert r.status_code == 201 and r.json()["adapters"] == [mine["id"]]
    dep = r.json()
    assert (await c.delete(f"{API}/adapters/{mine['id']}", headers=a.headers)).status_code == 409
    r = await c.patch(f"{API}/deployments/{dep['id']}", headers=a.headers, json={"adapters": []})
    assert r.json()["adapters"] == []
    assert (await c.delete(f"{API}/adapters/{mine['id']}", headers=a.headers)).status_code == 204


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_upload_into_s3(
    tmp_path: Path,
    model_cache: Path,
    sqlite_url: str,
    good_adapter: dict[str, bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TOKENMILL_STORAGE_URL=s3://... puts adapters in the bucket (moto's S3 server)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        bucket = f"tm-{os.urandom(4).hex()}"
        s3.create_bucket(Bucket=bucket)
        async with make_admin_env(
            tmp_path,
            model_cache,
            sqlite_url,
            storage_url=f"s3://{bucket}/tokenmill",
            s3_endpoint_url=endpoint,
            s3_region="us-east-1",
        ) as env:
            r = await env.upload(env.default_org, env.root, good_adapter)
            assert r.status_code == 201, r.text
            adapter = r.json()
            keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"])
            prefix = f"tokenmill/adapters/{env.default_org}/{adapter['id']}/"
            assert keys == [prefix + CONFIG, prefix + WEIGHTS]
            body = s3.get_object(Bucket=bucket, Key=prefix + WEIGHTS)["Body"].read()
            assert hashlib.sha256(body).hexdigest() == adapter["sha256"]
            async with env.app.state.sessionmaker() as s:
                row = await s.get(Adapter, adapter["id"])
            assert (
                row is not None
                and row.source == f"s3://{bucket}/tokenmill/adapters/{env.default_org}/{adapter['id']}"
            )
            assert (
                await env.client.delete(f"{API}/adapters/{adapter['id']}", headers=env.root)
            ).status_code == 204
            assert "Contents" not in s3.list_objects_v2(Bucket=bucket)
    finally:
        server.stop()


# --- bounded uploads ---------------------------------------------------------------------


class Body:
    """A multipart body sent as it is produced (the client never holds a large part)."""

    BOUNDARY = "tokenmill-test-boundary"

    def __init__(self, parts: list[tuple[str, str | None, int | bytes]]) -> None:
        self.parts = parts  # (field, file name or None, content or a size of zeros)

    @property
    def headers(self) -> dict[str, str]:
        return {"content-type": f"multipart/form-data; boundary={self.BOUNDARY}"}

    async def __aiter__(self) -> Any:
        for field, filename, content in self.parts:
            disposition = f'form-data; name="{field}"' + (f'; filename="{filename}"' if filename else "")
            yield f"--{self.BOUNDARY}\r\ncontent-disposition: {disposition}\r\n\r\n".encode()
            if isinstance(content, bytes):
                yield content
            else:
                chunk = bytes(1 << 20)
                for start in range(0, content, len(chunk)):
                    yield chunk[: min(len(chunk), content - start)]
            yield b"\r\n"
        yield f"--{self.BOUNDARY}--\r\n".encode()


async def post_streamed(env: AdminEnv, body: Body) -> Any:
    url = f"{API}/organizations/{env.default_org}/adapters"
    return await env.client.post(url, headers=env.root | body.headers, content=body)


@pytest.fixture
async def sqlite_env(tmp_path: Path, model_cache: Path, sqlite_url: str) -> Any:
    async with make_admin_env(tmp_path, model_cache, sqlite_url) as env:
        yield env


async def test_a_huge_text_field_is_refused_before_it_is_read(sqlite_env: AdminEnv) -> None:
    """The field that grew a server by 400 MB: a client announces 400 MB, sends its first
    MiB and waits. The answer comes then, so nothing waited for (or kept) the rest."""
    env = sqlite_env
    url = urlsplit(str(env.client.base_url))
    head = f'--{Body.BOUNDARY}\r\ncontent-disposition: form-data; name="name"\r\n\r\n'.encode()
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        request = (
            f"POST {API}/organizations/{env.default_org}/adapters HTTP/1.1\r\nhost: {url.hostname}\r\n"
            f"authorization: {env.root['authorization']}\r\n"
            f"content-type: {Body([]).headers['content-type']}\r\ncontent-length: {400 << 20}\r\n\r\n"
        )
        writer.write(request.encode() + head + b"a" * (1 << 20))
        await writer.drain()
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        length = re.search(rb"content-length: *(\d+)", answer, re.IGNORECASE)
        assert length, answer
        body = json.loads(await reader.readexactly(int(length[1])))
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer
    assert body["error"]["message"] == "Form field 'name' is larger than 4096 bytes."
    assert body["error"]["param"] == "name"
    assert await counts(env) == (0, 0)


async def test_weights_are_bounded_by_the_largest_adapter_the_base_model_takes(
    sqlite_env: AdminEnv,
) -> None:
    env = sqlite_env
    env.settings.max_lora_rank = 4
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    largest = lora_files(rank=4, targets=modules)  # every projection of every layer, float32
    # A and B of each projection hold rank * (in + out) floats; the header gets 64 KiB plus
    # 256 bytes a tensor.
    h, q, kv, mlp = SMOL["hidden"], SMOL["q"], SMOL["kv"], SMOL["intermediate"]
    in_out = (h + q) + 2 * (h + kv) + (q + h) + 3 * (h + mlp)
    tensors = SMOL["layers"] * len(modules) * 2
    limit = 8 + 64 * 1024 + 256 * tensors + SMOL["layers"] * in_out * 4 * 4
    assert limit - (64 * 1024 + 256 * tensors) < len(largest[WEIGHTS]) <= limit
    # The largest valid one passes ...
    r = await env.upload(env.default_org, env.root, largest, name="largest")
    assert r.status_code == 201, r.text
    # ... and anything longer is refused as it arrives, naming the limit.
    body = Body(
        [
            ("name", None, b"too-big"),
            ("model", None, MODEL.encode()),
            ("file", CONFIG, largest[CONFIG]),
            ("file", WEIGHTS, limit + (200 << 20)),
        ]
    )
    message = error(await post_streamed(env, body), 413, WEIGHTS)
    assert message == (
        f"File '{WEIGHTS}' is larger than {limit} bytes, the largest valid adapter for {MODEL} at rank 4."
    )
    # With a Content-Length announcing more than any valid upload, before the file is read.
    big = {CONFIG: largest[CONFIG], WEIGHTS: largest[WEIGHTS] + bytes(2 << 20)}
    r = await env.upload(env.default_org, env.root, big, name="announced")
    assert r.status_code == 413 and "The upload is larger than" in r.json()["error"]["message"], r.text
    assert await counts(env) == (1, 1)


async def test_upload_parts_in_order_and_no_more_than_needed(
    sqlite_env: AdminEnv, good_adapter: dict[str, bytes]
) -> None:
    env = sqlite_env
    cases: list[tuple[list[tuple[str, str | None, int | bytes]], int, str | None, str]] = [
        # the weights' limit depends on the model: it must come first
        (
            [("name", None, b"x"), ("file", CONFIG, good_adapter[CONFIG]), ("file", WEIGHTS, 100)],
            400,
            "model",
            "Send the 'model' field before adapter_model.safetensors",
        ),
        (
            [("name", None, b"x"), ("model", None, MODEL.encode()), ("file", "notes.txt", b"hi")],
            400,
            "file",
            "Unexpected file 'notes.txt'.",
        ),
        (
            [("model", None, MODEL.encode()), ("file", CONFIG, (1 << 20) + 1)],
            413,
            CONFIG,
            f"File '{CONFIG}' is larger than 1048576 bytes.",
        ),
        (
            [("model", None, MODEL.encode())] + [(f"f{i}", None, b"x") for i in range(16)],
            413,
            None,
            "The multipart body exceeds a limit",
        ),
        (
            [("model", None, b"no-such-model"), ("file", CONFIG, good_adapter[CONFIG])],
            400,
            "model",
            "No model 'no-such-model'.",
        ),
    ]
    for parts, status, param, says in cases:
        message = error(await post_streamed(env, Body(parts)), status, param)
        assert message.startswith(says), message
    # A truncated body is malformed, not a 500.
    url = f"{API}/organizations/{env.default_org}/adapters"
    raw = b"".join([chunk async for chunk in Body([("name", None, b"x"), ("model", None, MODEL.encode())])])
    r = await env.client.post(url, headers=env.root | Body([]).headers, content=raw[:-20])
    assert "The multipart body is malformed" in error(r, 400, None)
    assert await counts(env) == (0, 0) and list(env.storage.list("adapters/")) == []
