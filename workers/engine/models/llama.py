"""The Llama block family (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain torch.nn modules.

Tokens of all sequences in a step are laid end to end ([T, hidden], no batch dimension);
attention is the only place that knows about sequences, through the backend and metadata.
q/k/v and gate/up are fused into one matmul each; `load_weights` maps HF names onto them.

On the CPU in fp32 the model can run its elementwise work through the fused C ops
(`use_cpu_ops`, workers/engine/csrc/fused.c): add + RMSNorm, RoPE in place, SiLU * up. The
plain modules below stay the reference (and the path on GPUs, in half precision, or with the
"torch" attention backend).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from workers.engine.attention import AttentionBackend, AttentionMetadata
from workers.engine.config import ModelConfig
from workers.engine.linear import Linear
from workers.engine.meta import embedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 and scale after casting back, exactly as HF does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies of the rotary embedding, with linear or Llama-3 scaling."""
    dim = cfg.head_dim
    # An explicit device: the model may be built under `torch.device("meta")`.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # "llama3": long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # A plain attribute, not a buffer: it stays fp32 whatever the weights' dtype, and is
        # built on the CPU even when the model is constructed on the meta device.
        self.inv_freq = rope_inv_freq(cfg)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, head_dim], computed in fp32 from the positions (as HF does)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim]; HF's rotate-half layout (not interleaved pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.backend = backend

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata
    ) -> Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, h: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor], meta: AttentionMetadata
    ) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


# HF projection name -> (fused module, index of its shard in the fused output rows)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, backend)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.cpu_ops: object | None = None  # the C library of workers.engine.cpu_kernels

    def use_cpu_ops(self, lib: object | None) -> None:
        """Run fp32 CPU steps through the fused C ops (None: the plain modules)."""
        self.cpu_ops = lib

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output projection when the config says so
        (again after `meta.materialize`, which gives each parameter its own storage)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        keep: Tensor | None = None,
    ) -> Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden], or of the rows
        `keep` only ([len(keep), hidden]: the rows whose logits are wanted)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        if self.cpu_ops is not None and h.dtype == torch.float32 and h.device.type == "cpu":
            return self._forward_fused(h, cos, sin, kv_caches, meta, keep)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, meta)
        return self.model.norm(h if keep is None else h[keep])

    def _forward_fused(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        keep: Tensor | None = None,
    ) -> Tensor:
        """The same layers with their elementwise work in the C ops: the residual stream is
        added to in place, each add fused with the RMSNorm that follows it. With `keep`, the last
        layer's o_proj and MLP run on those rows only: past its attention (which every row's
        keys and values need) no other row is read, and in a prefill step that is ~1/30 of the
        projections."""
        from workers.engine import cpu_kernels as ops

        lib = self.cpu_ops
        eps = self.cfg.rms_norm_eps
        cos, sin = cos.contiguous(), sin.contiguous()
        residual = h.contiguous()  # the stream: embeddings, then += every attention and MLP output
        x = ops.rms_norm(lib, residual, self.model.layers[0].input_layernorm.weight, eps)  # type: ignore[arg-type]
        t = h.shape[0]
        last = len(self.model.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            attn = layer.self_attn
            if i:  # the previous layer's MLP output joins the stream, then this layer's norm
                x = ops.rms_norm(lib, x, layer.input_layernorm.weight, eps, residual)  # type: ignore[arg-type]
            qkv = attn.qkv_proj(x)
            q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
            q = q.view(t, attn.num_heads, attn.head_dim)
            k = k.view(t, attn.num_kv_heads, attn.head_dim)
            v = v.view(t, attn.num_kv_heads, attn.head_dim)
            ops.rope_(lib, q, k, cos, sin)  # type: ignore[arg-type]
            o = attn.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, attn.scale)
            if i == last and keep is not None:
                o, residual, t = o[keep], residual[keep], keep.numel()
            a = attn.o_proj(o.reshape(t, attn.q_size))
            x = ops.rms_norm(lib, a, layer.post_attention_layernorm.weight, eps, residual)  # type: ignore[arg-type]
            x = layer.mlp.down_proj(ops.silu_mul(lib, layer.mlp.gate_up_proj(x)))  # type: ignore[arg-type]
        return ops.rms_norm(lib, x, self.model.norm.weight, eps, residual)  # type: ignore[arg-type]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in fp32 (what the sampler works in)."""
        return self.lm_head(hidden).float()

    def shard_sizes(self, fused: str) -> list[int]:
        c = self.cfg
        if fused == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the
        fused parameters; raises if a tensor is unknown or a parameter is left unfilled."""
        params = dict(self.named_parameters())  # tied lm_head appears once, as embed_tokens
        filled: dict[str, set[int]] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # some checkpoints store it; it is recomputed from the config
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # a tied checkpoint may still carry a copy
            shard = 0
            module = name.split(".")[-2]
            if module in _PACKED:
                fused, shard = _PACKED[module]
                name = name.replace(module, fused)
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if module in _PACKED:
                sizes = self.shard_sizes(_PACKED[module][0])
                param = param.narrow(0, sum(sizes[:shard]), sizes[shard])
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.copy_(tensor)
            filled.setdefault(name, set()).add(shard)
        missing = []
        for name in params:
            module = name.split(".")[-2]
            shards = 3 if module == "qkv_proj" else 2 if module == "gate_up_proj" else 1
            if len(filled.get(name, ())) != shards:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:4]} ({len(missing)} in all)")
