"""The small batched encoder that serves embedding models (all-MiniLM-L6-v2 and other BERTs).

A BERT in plain PyTorch (no transformers at run time) plus sentence-transformers' pooling:
the directory's `modules.json` says which modules follow the transformer (for MiniLM: mean
pooling over the attention mask, then L2 normalisation).

- `Encoder(model_dir).encode(inputs)`: token ids in, one embedding per input out. Inputs are
  sorted by length and run in sub-batches padded to their longest member, so short inputs
  never pay for a long one's padding.
- `EmbedBatcher(encoder)`: concurrent requests collected for a few milliseconds (or until
  `max_inputs` inputs wait) and encoded in one forward pass on a thread of their own, so
  torch never blocks the event loop; results go back to each request in order.

The gateway tokenizes (`Tokenizer.encode(text, add_special_tokens=True)` gives [CLS] … [SEP],
identical to HF's tokenizer) and refuses inputs longer than `context_length`; the worker
checks again and refuses rather than truncates.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tokenmill.protocol import EmbedRequest, EmbedResponse
from workers.engine.meta import embedding, materialize

# Architectures this encoder reads (HF's names for a plain BERT stack).
ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
_POOLING_MODES = ("mean", "cls", "max")


class InvalidInput(ValueError):
    """A request the encoder cannot run; `param` names the offending field (OpenAI style)."""

    def __init__(self, message: str, param: str | None = "inputs") -> None:
        super().__init__(message)
        self.param = param


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def is_embedding_model(model_dir: str | Path) -> bool:
    """Whether a model directory holds a sentence encoder rather than a generative model:
    a sentence-transformers directory (modules.json) or a BERT checkpoint."""
    path = Path(model_dir)
    if (path / "modules.json").exists():
        return True
    try:
        config = _read_json(path / "config.json")
    except (OSError, ValueError):
        return False
    archs = config.get("architectures") or []
    return config.get("model_type") == "bert" or any(a in ARCHITECTURES for a in archs)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> BertConfig:
        if config.get("model_type", "bert") != "bert":
            raise ValueError(f"unsupported encoder model_type {config.get('model_type')!r} (only bert)")
        # Anything but absolute positions and exact GELU would run and silently embed wrongly.
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {config['position_embedding_type']!r}")
        if config.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} (only gelu)")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config.get("max_position_embeddings", 512),
            type_vocab_size=config.get("type_vocab_size", 2),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> BertConfig:
        return cls.from_hf(_read_json(Path(path) / "config.json"))


@dataclass(slots=True)
class Pooling:
    """How token states become one sentence vector (sentence-transformers' Pooling + Normalize)."""

    mode: str = "mean"  # mean | cls | max
    normalize: bool = True

    @classmethod
    def from_dir(cls, path: str | Path) -> Pooling:
        """Read modules.json and the pooling module's config. A directory without modules.json
        gets sentence-transformers' default for a plain model (mean) and, like OpenAI's
        embeddings, unit length."""
        path = Path(path)
        modules_file = path / "modules.json"
        if not modules_file.exists():
            return cls()
        modules = _read_json(modules_file)
        types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
        pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        if pooling is None:
            raise ValueError(f"{modules_file}: no Pooling module (modules: {', '.join(types)})")
        # Dense projections and the like would change the vector: refuse rather than skip them.
        extra = [t for t in types if t not in ("Transformer", "Pooling", "Normalize")]
        if extra:
            raise ValueError(f"{modules_file}: unsupported sentence-transformers modules {extra}")
        cfg = _read_json(path / pooling.get("path", "") / "config.json")
        modes = [
            mode
            for mode, key in (
                ("mean", "pooling_mode_mean_tokens"),
                ("cls", "pooling_mode_cls_token"),
                ("max", "pooling_mode_max_tokens"),
            )
            if cfg.get(key)
        ]
        unsupported = [
            k for k in ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_lasttoken") if cfg.get(k)
        ]
        if len(modes) != 1 or unsupported:
            raise ValueError(f"{path}: unsupported pooling {cfg} (exactly one of {_POOLING_MODES})")
        return cls(mode=modes[0], normalize="Normalize" in types)


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word = embedding(c.vocab_size, c.hidden_size)
        self.pos = embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type = embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, ids: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        # One segment per input: token type 0 everywhere, as HF does when none is given.
        return self.norm(self.word(ids) + self.pos(pos) + self.token_type.weight[0])


class BertLayer(nn.Module):
    """Post-norm block: attention + residual + norm, then GELU MLP + residual + norm."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.head_dim = c.hidden_size // c.num_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.o = nn.Linear(c.hidden_size, c.hidden_size)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size)
        self.mlp_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.attn_norm(x + self.o(a.transpose(1, 2).reshape(b, t, h)))
        return self.mlp_norm(x + self.down(F.gelu(self.up(x))))


class BertModel(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_layers))

    def forward(self, ids: Tensor, mask: Tensor | None) -> Tensor:
        """Last hidden states [B, T, H]; `mask` [B, T] is True on real tokens (None: no padding)."""
        # Padding keys are masked out; padded query rows still see the real keys, so no row
        # is all -inf (no NaN), and pooling ignores them anyway.
        attn = None if mask is None else mask[:, None, None, :]
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x, attn)
        return x

    def load_weights(self, weights: Iterator[tuple[str, Tensor]]) -> None:
        """Copy HF BERT tensors in, packing query/key/value into one qkv projection."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = _rename(hf_name)
            if target is None:
                continue
            name, shard = target
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected encoder weight {hf_name!r}")
            with torch.no_grad():
                if shard is None:
                    param.copy_(tensor)
                else:
                    size = param.shape[0] // 3
                    param[shard * size : (shard + 1) * size].copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        expected = {n for n in params if ".qkv." not in n} | {
            f"{n}#{s}" for n in params if ".qkv." in n for s in range(3)
        }
        if missing := sorted(expected - loaded):
            raise ValueError(f"encoder weights missing from the checkpoint: {missing[:6]}")


_LAYER_PARTS = {
    "attention.output.dense": "o",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "mlp_norm",
}
_EMBEDDING_PARTS = {
    "word_embeddings": "word",
    "position_embeddings": "pos",
    "token_type_embeddings": "token_type",
    "LayerNorm": "norm",
}
_QKV = {"query": 0, "key": 1, "value": 2}


def _rename(hf_name: str) -> tuple[str, int | None] | None:
    """Our parameter name (and q/k/v shard) for an HF BERT tensor; None for tensors we skip
    (the pooler, MLM heads, buffers like position_ids)."""
    name = hf_name.removeprefix("bert.")
    # Checkpoints from the TF era call LayerNorm parameters gamma and beta.
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    stem, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem.startswith("embeddings."):
        part = _EMBEDDING_PARTS.get(stem.removeprefix("embeddings."))
        return (f"embeddings.{part}.{kind}", None) if part else None
    if stem.startswith("encoder.layer."):
        index, _, rest = stem.removeprefix("encoder.layer.").partition(".")
        if rest.startswith("attention.self."):
            shard = _QKV.get(rest.removeprefix("attention.self."))
            return (f"layers.{index}.qkv.{kind}", shard) if shard is not None else None
        part = _LAYER_PARTS.get(rest)
        return (f"layers.{index}.{part}.{kind}", None) if part else None
    return None


def _weights(path: Path) -> Iterator[tuple[str, Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        return
    bin_file = path / "pytorch_model.bin"
    if not bin_file.exists():
        raise FileNotFoundError(f"{path}: no *.safetensors or pytorch_model.bin")
    # weights_only: a pickle from elsewhere must not run code on the worker.
    yield from torch.load(bin_file, map_location="cpu", weights_only=True).items()


# --------------------------------------------------------------------------------------------
# The encoder: token ids in, sentence embeddings out
# --------------------------------------------------------------------------------------------


class Encoder:
    """A sentence encoder over token ids; `encode` is blocking (call it off the event loop)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        max_batch_tokens: int = 8192,
    ) -> None:
        path = Path(model_dir)
        self.config = BertConfig.from_dir(path)
        self.pooling = Pooling.from_dir(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        # Padded tokens per forward pass: bounds the activations (attention scores grow with T²).
        self.max_batch_tokens = max_batch_tokens
        with torch.device("meta"):
            model = BertModel(self.config)
        model = materialize(model, dtype, self.device)
        model.load_weights(_weights(path))
        self.model = model.eval()

    @property
    def context_length(self) -> int:
        """Most tokens (special tokens included) one input may have."""
        return self.config.max_position_embeddings

    @property
    def max_tokens(self) -> int:
        return self.context_length

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def validate(self, inputs: list[list[int]]) -> None:
        if not inputs:
            raise InvalidInput("inputs must not be empty")
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidInput(f"input {i} has no tokens")
            if len(ids) > self.context_length:
                raise InvalidInput(
                    f"input {i} has {len(ids)} tokens; the model's context length is {self.context_length}"
                )
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise InvalidInput(f"input {i}: token ids must be in [0, {self.vocab_size})")

    @torch.inference_mode()
    def encode(self, inputs: list[list[int]]) -> Tensor:
        """Embeddings [len(inputs), dimensions] in input order (float32, on the CPU)."""
        self.validate(inputs)
        out = torch.empty(len(inputs), self.dimensions, dtype=torch.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]), reverse=True)
        start = 0
        while start < len(order):
            # Longest first: the chunk's first member fixes its padded length.
            longest = len(inputs[order[start]])
            size = max(1, min(len(order) - start, self.max_batch_tokens // longest))
            chunk = order[start : start + size]
            out[chunk] = self._forward([inputs[i] for i in chunk]).float().cpu()
            start += size
        return out

    def _forward(self, batch: list[list[int]]) -> Tensor:
        longest = max(len(ids) for ids in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.bool)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        padded = any(len(seq) != longest for seq in batch)
        hidden = self.model(ids, mask if padded else None)
        return self._pool(hidden, mask)

    def _pool(self, hidden: Tensor, mask: Tensor) -> Tensor:
        if self.pooling.mode == "cls":
            vec = hidden[:, 0]
        elif self.pooling.mode == "max":
            vec = hidden.masked_fill(~mask[..., None], float("-inf")).amax(dim=1)
        else:
            weights = mask[..., None].to(hidden.dtype)
            # clamp as sentence-transformers does (it only matters for an all-padding row)
            vec = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return F.normalize(vec, p=2, dim=-1) if self.pooling.normalize else vec


# --------------------------------------------------------------------------------------------
# The batcher: concurrent requests, one forward pass
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Job:
    inputs: list[list[int]]
    future: asyncio.Future[list[list[float]]]
    arrived: float = field(default_factory=time.monotonic)


class EmbedBatcher:
    """Serves `EmbedRequest`s from one `Encoder`, batching concurrent requests.

    A batch closes `max_wait` seconds after its oldest request arrived, or as soon as
    `max_inputs` inputs wait (a bigger single request is still taken whole; the encoder
    splits it by `max_batch_tokens`). Requests that arrive during a forward pass wait for
    the next one, whose window has usually already elapsed: under load batches run back to
    back. One thread runs the model, so passes never compete for the same cores.
    """

    def __init__(self, encoder: Encoder, *, max_wait: float = 0.005, max_inputs: int = 64) -> None:
        self.encoder = encoder
        self.max_wait = max_wait
        self.max_inputs = max_inputs
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder")
        self._pending: deque[_Job] = deque()
        self._queued_inputs = 0
        self._running = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived = asyncio.Event()
        self._full = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.batches = 0  # forward passes run (for tests and metrics)

    # --- load, for metrics and heartbeats --------------------------------------------------

    @property
    def running(self) -> int:
        """Requests in the forward pass now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Requests queued for the next forward pass."""
        return len(self._pending)

    @property
    def kv_usage(self) -> float:
        # Heartbeats carry every worker's KV cache usage; an encoder keeps no cache.
        return 0.0

    @property
    def context_length(self) -> int:
        return self.encoder.context_length

    def close(self) -> None:
        if self._task is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._executor.shutdown(wait=True, cancel_futures=True)

    # --- requests ----------------------------------------------------------------------------

    def validate(self, req: EmbedRequest) -> None:
        self.encoder.validate(req.inputs)

    async def embed(self, req: EmbedRequest) -> EmbedResponse:
        vectors = await self.encode(req.inputs)
        return EmbedResponse(embeddings=vectors, prompt_tokens=sum(len(ids) for ids in req.inputs))

    async def encode(self, inputs: list[list[int]]) -> list[list[float]]:
        """Embeddings of `inputs`, computed in a batch with whatever else arrives meanwhile."""
        self.encoder.validate(inputs)  # a bad request must not fail the others of its batch
        self._start()
        job = _Job(inputs, asyncio.get_running_loop().create_future())
        self._pending.append(job)
        self._queued_inputs += len(inputs)
        self._arrived.set()
        if self._queued_inputs >= self.max_inputs:
            self._full.set()
        # Cancelling this await (client gone) cancels the future; the batcher then skips it.
        return await job.future

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and self._loop is loop and not self._task.done():
            return
        # First request, or the batcher is used from a new event loop.
        self._loop = loop
        self._arrived, self._full = asyncio.Event(), asyncio.Event()
        self._task = loop.create_task(self._run(), name="embed-batcher")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
            # The window counts from the oldest request's arrival, so a request that waited
            # through the previous forward pass does not wait again.
            deadline = self._pending[0].arrived + self.max_wait
            while self._queued_inputs < self.max_inputs and (remaining := deadline - time.monotonic()) > 0:
                self._full.clear()
                try:
                    async with asyncio.timeout(remaining):
                        await self._full.wait()
                except TimeoutError:
                    break
            jobs = self._take()
            if not jobs:
                continue
            self._running = len(jobs)
            try:
                flat = [ids for job in jobs for ids in job.inputs]
                vectors = await loop.run_in_executor(self._executor, self._encode, flat)
            except Exception as exc:
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(exc)
            else:
                start = 0
                for job in jobs:
                    end = start + len(job.inputs)
                    if not job.future.done():  # cancelled meanwhile: the client is gone
                        job.future.set_result(vectors[start:end])
                    start = end
            finally:
                self._running = 0
                self.batches += 1

    def _take(self) -> list[_Job]:
        """Pending jobs up to `max_inputs` inputs (at least one job), skipping cancelled ones."""
        jobs: list[_Job] = []
        count = 0
        while self._pending and (not jobs or count + len(self._pending[0].inputs) <= self.max_inputs):
            job = self._pending.popleft()
            self._queued_inputs -= len(job.inputs)
            if job.future.done():
                continue
            jobs.append(job)
            count += len(job.inputs)
        if self._queued_inputs < self.max_inputs:
            self._full.clear()
        return jobs

    def _encode(self, inputs: list[list[int]]) -> list[list[float]]:
        # tolist() here, on the model's thread: converting thousands of floats is not free.
        result: list[list[float]] = self.encoder.encode(inputs).tolist()
        return result
