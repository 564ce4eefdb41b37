output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = module.cluster.name
}

output "kubeconfig_command" {
  description = "Adds the cluster to your kubeconfig."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.cluster.name}"
}

output "namespace" {
  description = "Namespace of Tokenmill."
  value       = module.tokenmill.namespace
}

output "api_url" {
  description = "OpenAI-compatible base URL (point the DNS name of api_host at the load balancer the Ingress gets)."
  value       = var.api_host == null ? null : "https://${var.api_host}/v1"
}

output "admin_url" {
  description = "Admin API and dashboard (internal load balancer)."
  value       = var.admin_host == null ? null : "https://${var.admin_host}"
}

output "database_address" {
  description = "Host name of PostgreSQL (private)."
  value       = module.database.address
}

output "redis_endpoint" {
  description = "Host name of the Redis primary (private, TLS)."
  value       = module.cache.primary_endpoint
}

output "storage_url" {
  description = "Where weights, adapters and exports are stored (TOKENMILL_STORAGE_URL)."
  value       = module.storage.storage_url
}

output "gpu_types" {
  description = "GPU types the cluster offers (the gpu_type of a deployment must be one of them)."
  value       = module.cluster.gpu_types
}

output "worker_templates" {
  description = "Worker Deployment templates in the ConfigMap tokenmill-worker-templates, per GPU type."
  value       = module.tokenmill.worker_templates
}

output "nat_public_ips" {
  description = "Addresses the cluster's outbound traffic comes from."
  value       = module.network.nat_public_ips
}
