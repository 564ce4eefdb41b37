output "namespace" {
  description = "Namespace of Tokenmill and its workers."
  value       = kubernetes_namespace_v1.this.metadata[0].name
}

output "gateway_service" {
  description = "Service of the gateways (port 80), for an ingress controller or a port-forward."
  value       = kubernetes_service_v1.gateway.metadata[0].name
}

output "control_plane_service" {
  description = "Service of the control plane (port 80): admin API, dashboard, Stripe webhook."
  value       = kubernetes_service_v1.control_plane.metadata[0].name
}

output "service_accounts" {
  description = "Service account of each component (the storage module's IRSA roles trust these names)."
  value       = { for key, account in kubernetes_service_account_v1.this : key => account.metadata[0].name }
}

output "worker_secret" {
  description = "Secret the worker pods take their environment from (TOKENMILL_WORKER_SECRET), rendered by External Secrets."
  value       = local.worker_secret
}

output "rollout" {
  description = "The graceful-rollout timings (seconds): deregistration delay, preStop, graceful shutdown, grace periods."
  value = {
    max_stream                = module.rollout.max_stream_seconds
    deregistration_delay      = module.rollout.deregistration_delay_seconds
    prestop                   = module.rollout.prestop_seconds
    graceful_shutdown         = module.rollout.graceful_shutdown_seconds
    termination_grace_period  = module.rollout.termination_grace_period_seconds
    worker_termination_period = module.rollout.worker_termination_grace_period_seconds
  }
}

output "worker_templates" {
  description = "Name of the worker Deployment template for each GPU type (and cpu), in the ConfigMap tokenmill-worker-templates."
  value       = { for kind, template in module.worker_template : kind => template.name }
}

output "migration_job" {
  description = "Name of the Job that ran the migrations of the current image."
  value       = kubernetes_job_v1.migrate.metadata[0].name
}
