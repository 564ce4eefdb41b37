"""The catalogue: base models, LoRA adapters, deployments and their workers' lifetimes."""
