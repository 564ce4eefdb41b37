"""Triton kernels for the engine (GPU; on CPU only under TRITON_INTERPRET=1).

Importing this package defines the kernels, and Triton decides at definition time whether they
run compiled or interpreted (TRITON_INTERPRET), so import it only when the Triton backend is used.
"""

from workers.engine.kernels.lora_expand import lora_expand
from workers.engine.kernels.lora_shrink import lora_shrink
from workers.engine.kernels.store_kv import store_kv
from workers.engine.kernels.unified_attention import unified_attention

__all__ = ["lora_expand", "lora_shrink", "store_kv", "unified_attention"]
