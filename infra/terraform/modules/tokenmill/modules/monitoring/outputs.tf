output "manifests" {
  description = "The PodMonitors of the services and the workers, and the PrometheusRule of the alerts."
  value       = [local.service_monitor, local.worker_monitor, local.rules]
}
