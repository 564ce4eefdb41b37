"""What an embedding model can give, known before any worker runs.

A request for embeddings the model cannot make (a `dimensions` other than its own) is
refused by the gateway, so no worker computes them and nobody is billed for them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.errors import APIError


def vector_size(model_dir: Path) -> int | None:
    """The length of the vectors an embedding model in `model_dir` makes: its `hidden_size`.
    The worker's encoder (workers/encoder.py) pools the last hidden states and refuses models
    whose sentence-transformers modules would project them to another size, so its vectors
    are exactly that long. None when the directory does not say (not a model we encode)."""
    try:
        size = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("hidden_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def check_dimensions(dimensions: int, model: str, size: int | None) -> None:
    """Refuse a `dimensions` the model cannot give, before any worker computes anything: the
    encoder cannot shorten its vectors (its models are not trained to keep their meaning
    when cut), so the only size it makes is its own. Unknown size: the worker's answer is
    checked instead (`embedding_list`)."""
    if size is None or dimensions == size:
        return
    if dimensions > size:
        message = (
            f"The model '{model}' makes {size}-dimensional embeddings: "
            f"'dimensions' cannot be more than {size}."
        )
    else:
        message = (
            f"The model '{model}' cannot shorten its {size}-dimensional embeddings: "
            f"leave 'dimensions' out or set it to {size}."
        )
    raise APIError(400, message, param="dimensions")
