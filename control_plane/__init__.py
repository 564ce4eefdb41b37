"""Control plane: organisations, users, API keys, models, adapters, deployments, plans, workers."""
