"""Model implementations; every supported architecture is the Llama block (see config.py)."""

from workers.engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
