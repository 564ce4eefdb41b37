output "api_url" {
  description = "OpenAI-compatible base URL."
  value       = var.api_host == null ? null : "https://${var.api_host}/v1"
}

output "admin_url" {
  description = "Admin API and dashboard (internal load balancer)."
  value       = var.admin_host == null ? null : "https://${var.admin_host}"
}

output "gpu_types" {
  description = "GPU types the cluster offers (the gpu_type of a deployment must be one of them)."
  value       = module.gpu_pools.gpu_types
}

output "worker_resources" {
  description = "One GPU's share of a worker pod per GPU type (TOKENMILL_WORKER_RESOURCES)."
  value       = module.worker_sizing.worker_resources
}

output "max_gpus_per_worker" {
  description = "Per GPU type, the most GPUs one worker may ask (its largest node type)."
  value       = module.worker_sizing.max_gpus_per_pod
}

output "rollout" {
  description = "Graceful-rollout timings in seconds (ALB deregistration delay, preStop, graceful shutdown, grace periods)."
  value       = module.tokenmill.rollout
}

output "worker_templates" {
  description = "Worker Deployment templates in the ConfigMap tokenmill-worker-templates, per GPU type."
  value       = module.tokenmill.worker_templates
}
