output "gpu_node_daemonset_requests" {
  description = "What the DaemonSets on a GPU node request together (modules/worker-sizing's daemonset_requests must be at least this)."
  value = {
    cpu_millis = sum([for d in values(local.gpu_node_daemonsets) : d.cpu_millis])
    memory_mib = sum([for d in values(local.gpu_node_daemonsets) : d.memory_mib])
  }
}

output "monitoring_namespace" {
  description = "Namespace of Prometheus (allowed to scrape the workers)."
  value       = kubernetes_namespace_v1.monitoring.metadata[0].name
}

output "ready" {
  description = "Names of the releases Tokenmill's objects depend on (External Secrets' and the Prometheus operator's CRDs, the load balancer controller's webhook)."
  value = {
    external_secrets      = helm_release.external_secrets.name
    kube_prometheus_stack = helm_release.kube_prometheus_stack.name
    load_balancer         = helm_release.load_balancer_controller.name
    gpu_pools             = helm_release.gpu_pools.name
  }
}
