output "name" {
  description = "Name of the worker Deployment."
  value       = local.name
}

output "manifest" {
  description = "The apps/v1 Deployment, as the autoscaler's worker_manifest() builds it."
  value       = local.manifest
}

output "disruption_budget" {
  description = "The PodDisruptionBudget the autoscaler keeps beside the Deployment (worker_disruption_budget())."
  value       = local.disruption_budget
}
