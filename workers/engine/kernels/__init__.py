"""Triton kernels for the engine (GPU; on CPU only under TRITON_INTERPRET=1).

Importing this package defines the kernels, and Triton decides at definition time whether they
run compiled or interpreted (TRITON_INTERPRET), so import it only when the Triton backend is used.
"""

from workers.engine.kernels.store_kv import store_kv
from workers.engine.kernels.unified_attention import unified_attention

__all__ = ["store_kv", "unified_attention"]
