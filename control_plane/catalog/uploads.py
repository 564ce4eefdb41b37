"""Reading an adapter upload off the wire (multipart/form-data), for the admin API and the
dashboard alike: what arrives is refused as early as it can be, and what is kept goes to
`AdapterService.upload`."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.datastructures import UploadFile
from multipart import MultipartSegment

from control_plane.catalog import lora
from control_plane.catalog.adapters import AdapterFiles, AdapterService
from tokenmill.bodies import MULTIPART_HEADER_BYTES, Form, read_multipart
from tokenmill.errors import APIError

UPLOAD_HELP = (
    "Upload a PEFT LoRA adapter as multipart/form-data: text fields 'name' and 'model' (the base "
    f"model's id or name), then the files {lora.CONFIG_FILE} and {lora.WEIGHTS_FILE}."
)
# A text field of an upload (a name, a model id, a CSRF token) and parts in all: what a
# valid upload needs, with room to spare, and not a byte of memory more.
UPLOAD_FIELD_BYTES = 4096
UPLOAD_PARTS = 16


@dataclass(slots=True)
class AdapterUpload:
    """An adapter upload as received: its form (close it when done) and its files."""

    form: Form
    files: AdapterFiles


def _file_role(field: str, filename: str | None) -> str:
    """Which file of an adapter a part is: by file name or by field name, so
    `-F file=@adapter_config.json`, `-F adapter_config.json=@x.json` and the dashboard's
    `config`/`weights` inputs all work."""
    base = os.path.basename(filename or "")
    if "adapter_model.bin" in (base, field) or (field == "weights" and base.endswith(".bin")):
        raise APIError(
            400,
            "Pickled adapter_model.bin files are not accepted (loading them runs code); "
            f"save the adapter with safetensors ({lora.WEIGHTS_FILE}).",
            param=lora.WEIGHTS_FILE,
        )
    if lora.CONFIG_FILE in (base, field) or field == "config":
        return lora.CONFIG_FILE
    if lora.WEIGHTS_FILE in (base, field) or field == "weights":
        return lora.WEIGHTS_FILE
    raise APIError(400, f"Unexpected file '{base or field}'. {UPLOAD_HELP}", param=field)


async def read_adapter_upload(
    request: Request[Any, Any, Any],
    adapters: AdapterService,
    *,
    before_files: Callable[[Form], Awaitable[None]] | None = None,
) -> AdapterUpload:
    """Stream an adapter upload in, refusing it (413) as soon as a part passes its limit:
    text fields `UPLOAD_FIELD_BYTES`, the config 1 MiB, the weights the largest valid
    adapter for the base model at `TOKENMILL_MAX_LORA_RANK` (so `model` must come before
    the weights). `before_files` runs once, on the text fields, before any file is read
    (the dashboard checks its CSRF token and organisation there)."""
    content_type, options = request.content_type
    boundary = options.get("boundary")
    if content_type != "multipart/form-data" or not boundary:
        raise APIError(415, UPLOAD_HELP)
    max_rank = adapters.config.max_lora_rank
    checked = False
    weights: tuple[int, str] | None = None

    async def check(form: Form) -> None:
        nonlocal checked
        if not checked and before_files is not None:
            await before_files(form)
        checked = True

    async def file_limit(part: MultipartSegment, form: Form) -> tuple[int, str]:
        nonlocal weights
        await check(form)
        role = _file_role(part.name or "", part.filename)
        if any(_file_role(f, u.filename) == role for f, u in form.files):
            raise APIError(400, f"{role} was sent twice.", param=role)
        model = (form.text("model") or "").strip()
        if role == lora.WEIGHTS_FILE and not model:
            raise APIError(
                400,
                f"Send the 'model' field before {lora.WEIGHTS_FILE} (its size limit depends on the "
                f"base model). {UPLOAD_HELP}",
                param="model",
            )
        if weights is None and model:
            name, size = await adapters.weights_limit(model)
            why = f", the largest valid adapter for {name} at rank {max_rank}"
            weights = size, why
            # Everything a valid upload can hold: refuse a larger announced body before reading it.
            whole = size + lora.MAX_CONFIG + UPLOAD_PARTS * (UPLOAD_FIELD_BYTES + MULTIPART_HEADER_BYTES * 8)
            if (request.content_length or 0) > whole:
                raise APIError(
                    413, f"The upload is larger than {whole} bytes{why}.", code="request_too_large"
                )
        if role == lora.CONFIG_FILE:
            return lora.MAX_CONFIG, ""
        assert weights is not None
        return weights

    form = await read_multipart(
        request.stream(),
        boundary.encode(),
        text_limit=UPLOAD_FIELD_BYTES,
        max_parts=UPLOAD_PARTS,
        file_limit=file_limit,
    )
    try:
        await check(form)  # an upload without files still has its fields checked
        # The first of each, as the weights' limit was decided from the first `model`.
        fields = {param: form.text(param) or "" for param in ("name", "model")}
        for param, value in fields.items():
            if not value.strip():
                raise APIError(400, f"'{param}' is missing. {UPLOAD_HELP}", param=param)
        files = {_file_role(f, u.filename): u for f, u in form.files}
        for name in (lora.CONFIG_FILE, lora.WEIGHTS_FILE):
            if name not in files:
                raise APIError(400, f"{name} is missing. {UPLOAD_HELP}", param=name)
        config = await files[lora.CONFIG_FILE].read()
        weights_file = files[lora.WEIGHTS_FILE]
        size = await asyncio.to_thread(_file_size, weights_file)
    except BaseException:
        await form.close()
        raise
    adapter = AdapterFiles(fields["name"], fields["model"].strip(), config, weights_file.file, size)
    return AdapterUpload(form, adapter)


def _file_size(upload: UploadFile) -> int:
    upload.file.seek(0, os.SEEK_END)
    size = upload.file.tell()
    upload.file.seek(0)
    return size
