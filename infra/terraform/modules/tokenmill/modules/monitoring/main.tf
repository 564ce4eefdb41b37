# What Prometheus (kube-prometheus-stack, modules/addons) scrapes of Tokenmill and when it
# alerts. Pure (no provider): modules/tokenmill applies these objects, tests read them.

locals {
  labels = { "app.kubernetes.io/part-of" = "tokenmill" }

  # The services' /metrics (gateway, control plane, autoscaler) answer the workers' token too:
  # one Secret, the narrowest token, reads every process's metrics.
  scrape_token = { type = "Bearer", credentials = { name = var.metrics_secret, key = "token" } }

  service_monitor = {
    apiVersion = "monitoring.coreos.com/v1"
    kind       = "PodMonitor"
    metadata   = { name = "tokenmill-services", namespace = var.namespace, labels = local.labels }
    spec = {
      selector = { matchExpressions = [{ key = "app.kubernetes.io/name", operator = "In", values = var.services }] }
      podMetricsEndpoints = [{
        port          = "http"
        path          = "/metrics"
        interval      = "30s"
        authorization = local.scrape_token
      }]
    }
  }

  # Workers have no Service (the gateways find them on the bus): a PodMonitor, with the token
  # every worker endpoint but /ready asks for.
  worker_monitor = {
    apiVersion = "monitoring.coreos.com/v1"
    kind       = "PodMonitor"
    metadata   = { name = "tokenmill-workers", namespace = var.namespace, labels = local.labels }
    spec = {
      selector = { matchLabels = { "app.kubernetes.io/name" = "tokenmill-worker" } }
      podMetricsEndpoints = [{
        port          = "http"
        path          = "/metrics"
        interval      = "15s"
        authorization = local.scrape_token
      }]
    }
  }

  ns = "namespace=\"${var.namespace}\""

  alerts = [
    {
      alert       = "TokenmillGatewaysDown"
      expr        = "kube_deployment_status_replicas_available{${local.ns}, deployment=\"tokenmill-gateway\"} < 1"
      duration    = "2m"
      severity    = "critical"
      summary     = "No gateway is available: the API answers nothing."
      description = "kubectl -n ${var.namespace} describe deploy/tokenmill-gateway; its pods' events and logs say why."
    },
    {
      alert       = "TokenmillScrapeTargetDown"
      expr        = "up{${local.ns}} == 0"
      duration    = "5m"
      severity    = "warning"
      summary     = "{{ $labels.pod }} does not answer /metrics."
      description = "The pod is up but its metrics endpoint is not reachable (NetworkPolicy, token, or a hung process)."
    },
    {
      alert       = "TokenmillWorkersPending"
      expr        = "sum by (namespace) (kube_pod_status_phase{${local.ns}, phase=\"Pending\", pod=~\"tm-worker-.*\"}) > 0"
      duration    = "${var.max_pending_worker_minutes}m"
      severity    = "warning"
      summary     = "Worker pods have waited for a GPU node for ${var.max_pending_worker_minutes} minutes."
      description = "Karpenter could not launch a node: the GPU quota of the account (G/P instances start at 0 vCPUs), the NodePool's GPU limit, or no capacity of the instance types in the zones. kubectl get nodeclaims; kubectl -n kube-system logs deploy/karpenter."
    },
    {
      alert       = "TokenmillWorkerBacklog"
      expr        = "max by (pod, model_name) (vllm:num_requests_waiting{${local.ns}}) > 32"
      duration    = "10m"
      severity    = "warning"
      summary     = "{{ $labels.pod }} has had more than 32 requests waiting for 10 minutes."
      description = "The deployment needs more replicas (its max_replicas, or the GPU pool's limit) or the worker is stuck."
    },
    {
      alert       = "TokenmillKvCacheFull"
      expr        = "max by (pod, model_name) (vllm:kv_cache_usage_perc{${local.ns}}) > 0.95"
      duration    = "15m"
      severity    = "info"
      summary     = "{{ $labels.pod }}'s KV cache has been over 95% full for 15 minutes (preemptions likely)."
      description = "Lower max_num_seqs, raise replicas, or use a larger GPU for this model."
    },
    {
      alert       = "TokenmillPodRestarting"
      expr        = "increase(kube_pod_container_status_restarts_total{${local.ns}}[15m]) > 3"
      duration    = "0m"
      severity    = "warning"
      summary     = "{{ $labels.pod }} restarted more than 3 times in 15 minutes."
      description = "kubectl -n ${var.namespace} logs {{ $labels.pod }} --previous"
    },
    {
      alert       = "TokenmillMigrationFailed"
      expr        = "kube_job_status_failed{${local.ns}, job_name=~\"tokenmill-migrate-.*\"} > 0"
      duration    = "0m"
      severity    = "critical"
      summary     = "The migration Job {{ $labels.job_name }} failed: the rollout is held back."
      description = "kubectl -n ${var.namespace} logs job/{{ $labels.job_name }}"
    },
    {
      alert       = "GpuXidErrors"
      expr        = "max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS) > 0"
      duration    = "0m"
      severity    = "critical"
      summary     = "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} reports XID error {{ $value }}."
      description = "Hardware or driver fault: cordon and drain the node (Karpenter replaces it)."
    },
    {
      alert       = "GpuTemperatureHigh"
      expr        = "max by (Hostname, gpu) (DCGM_FI_DEV_GPU_TEMP) > 85"
      duration    = "10m"
      severity    = "warning"
      summary     = "GPU {{ $labels.gpu }} on {{ $labels.Hostname }} has been above 85 C for 10 minutes."
      description = "It throttles; check the instance's health in EC2."
    },
  ]

  # The alerts on Tokenmill's own metrics (the TTFT SLO, errors, workers, ledger, spool): one
  # rule file that plain Prometheus loads as it is and tests/infra/test_grafana.py checks.
  platform_groups = yamldecode(file("${path.module}/../../../../../prometheus/alerts.yml")).groups

  rules = {
    apiVersion = "monitoring.coreos.com/v1"
    kind       = "PrometheusRule"
    metadata   = { name = "tokenmill", namespace = var.namespace, labels = local.labels }
    spec = {
      groups = concat([{
        name = "tokenmill"
        rules = [
          for a in local.alerts : {
            alert       = a.alert
            expr        = a.expr
            "for"       = a.duration
            labels      = { severity = a.severity }
            annotations = { summary = a.summary, description = a.description }
          }
        ]
      }], local.platform_groups)
    }
  }
}
