output "name" {
  description = "Name of the worker Deployment."
  value       = local.name
}

output "manifest" {
  description = "The apps/v1 Deployment, as the autoscaler's worker_manifest() builds it."
  value       = local.manifest
}
