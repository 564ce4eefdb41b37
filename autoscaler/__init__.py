"""Autoscaler: the reconciler, the scaling policy and providers (local processes, Kubernetes)."""
