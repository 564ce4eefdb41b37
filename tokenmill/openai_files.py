"""The wire schemas of OpenAI's Files API (`/v1/files`), field for field as the official
`openai` SDK reads them (`openai.types.FileObject`, `FileDeleted`, its cursor page)."""

from __future__ import annotations

from typing import Literal

import msgspec

# What a file is for. Only `batch` files are uploaded; `batch_output` files (a batch's output
# and error files) are made by the server. OpenAI's other purposes serve APIs not served here.
FilePurpose = Literal["batch", "batch_output"]


class FileObject(msgspec.Struct, kw_only=True):
    id: str  # file-...
    object: Literal["file"] = "file"
    bytes: int
    created_at: int  # Unix seconds
    filename: str
    purpose: FilePurpose
    # Deprecated at OpenAI, still sent: a file is whole once it is listed, so always processed.
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None  # files are kept until deleted
    status_details: str | None = None


class FileList(msgspec.Struct):
    """`GET /v1/files`: a cursor page (the next one starts `after` the last id)."""

    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: Literal["list"] = "list"


class FileDeleted(msgspec.Struct):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
