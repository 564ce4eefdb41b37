# The cluster's add-ons, installed with Helm (charts pinned by version), each running as the
# service account modules/addons-aws bound to its IAM role through EKS Pod Identity:
#
#   AWS Load Balancer Controller  Ingresses -> ALBs; pod readiness gates for the targets
#   Karpenter                     GPU nodes for pending worker pods (modules/gpu-pools' NodePools)
#   NVIDIA device plugin          only where the AMI lacks it (AL2023; Bottlerocket has it)
#   external-dns                  the API and admin host names in Route 53 (optional)
#   kube-prometheus-stack         Prometheus, Alertmanager, node-exporter, kube-state-metrics
#                                 (modules/tokenmill adds its ServiceMonitors, PodMonitor, rules)
#   dcgm-exporter                 GPU metrics on the GPU nodes
#   Fluent Bit                    every container's log lines to CloudWatch Logs
#   External Secrets              Kubernetes Secrets from Secrets Manager (modules/tokenmill)
#
# metrics-server and the Pod Identity agent are EKS add-ons (modules/cluster).

locals {
  system      = { "tokenmill.dev/pool" = "system" }
  gpu         = { "tokenmill.dev/pool" = "gpu" }
  gpu_taint   = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  everywhere  = [{ operator = "Exists" }] # node agents run on every node, tainted or not
  sa          = var.service_accounts
  raw_chart   = "${path.module}/../../charts/manifests"
  use_dns     = var.external_dns != null
  use_plugins = var.install_device_plugin

  # What every DaemonSet on a GPU node requests (what is set below, and the EKS add-ons' own):
  # modules/worker-sizing keeps this much of each GPU node for them.
  gpu_node_daemonsets = merge(
    {
      aws-node               = { cpu_millis = 25, memory_mib = 0 }  # VPC CNI (EKS add-on)
      kube-proxy             = { cpu_millis = 100, memory_mib = 0 } # EKS add-on
      eks-pod-identity-agent = { cpu_millis = 25, memory_mib = 64 } # EKS add-on
      node-exporter          = { cpu_millis = 50, memory_mib = 64 } # kube-prometheus-stack
      dcgm-exporter          = { cpu_millis = 100, memory_mib = 256 }
      fluent-bit             = { cpu_millis = 50, memory_mib = 128 }
    },
    local.use_plugins ? { nvidia-device-plugin = { cpu_millis = 50, memory_mib = 64 } } : {},
  )
}

# --- namespaces ------------------------------------------------------------------------------

# node-exporter (host network and PID, host paths) and dcgm-exporter (SYS_ADMIN for the GPU
# profiling counters) cannot meet the restricted Pod Security Standard: privileged, here only.
resource "kubernetes_namespace_v1" "monitoring" {
  metadata {
    name = "monitoring"
    labels = {
      "pod-security.kubernetes.io/enforce" = "privileged"
      "pod-security.kubernetes.io/warn"    = "baseline"
    }
  }
}

# Fluent Bit reads the nodes' /var/log (host paths): privileged, here only.
resource "kubernetes_namespace_v1" "logging" {
  metadata {
    name = local.sa["fluent-bit"].namespace
    labels = {
      "pod-security.kubernetes.io/enforce" = "privileged"
      "pod-security.kubernetes.io/warn"    = "baseline"
    }
  }
}

resource "kubernetes_namespace_v1" "external_secrets" {
  metadata {
    name = "external-secrets"
    labels = {
      "pod-security.kubernetes.io/enforce" = "restricted"
    }
  }
}

# --- load balancers ------------------------------------------------------------------------

resource "helm_release" "load_balancer_controller" {
  name       = "aws-load-balancer-controller"
  repository = "https://aws.github.io/eks-charts"
  chart      = "aws-load-balancer-controller"
  version    = var.chart_versions.aws_load_balancer_controller
  namespace  = local.sa["aws-load-balancer-controller"].namespace
  wait       = true

  values = [yamlencode({
    clusterName    = var.cluster_name
    region         = var.region
    vpcId          = var.vpc_id
    replicaCount   = 2
    serviceAccount = { create = true, name = local.sa["aws-load-balancer-controller"].name }
    nodeSelector   = local.system
    # Its webhook injects the target-health readiness gates into pods of namespaces labelled
    # elbv2.k8s.aws/pod-readiness-gate-inject=enabled (modules/tokenmill's).
    enableServiceMutatorWebhook = false
    resources                   = { requests = { cpu = "100m", memory = "128Mi" }, limits = { memory = "256Mi" } }
  })]
}

# --- GPU nodes -------------------------------------------------------------------------------

resource "helm_release" "karpenter_crd" {
  name       = "karpenter-crd"
  repository = "oci://public.ecr.aws/karpenter"
  chart      = "karpenter-crd"
  version    = var.chart_versions.karpenter
  namespace  = local.sa["karpenter"].namespace
}

resource "helm_release" "karpenter" {
  name       = "karpenter"
  repository = "oci://public.ecr.aws/karpenter"
  chart      = "karpenter"
  version    = var.chart_versions.karpenter
  namespace  = local.sa["karpenter"].namespace
  skip_crds  = true # karpenter-crd owns them (Helm never upgrades a chart's crds/)
  wait       = true

  values = [yamlencode({
    settings       = { clusterName = var.cluster_name, interruptionQueue = var.karpenter_interruption_queue }
    serviceAccount = { create = true, name = local.sa["karpenter"].name }
    replicas       = 2
    nodeSelector   = local.system # the managed system nodes: Karpenter never runs on its own nodes
    controller = {
      resources = { requests = { cpu = "500m", memory = "512Mi" }, limits = { memory = "1Gi" } }
    }
  })]

  depends_on = [helm_release.karpenter_crd]
}

resource "helm_release" "gpu_pools" {
  name      = "tokenmill-gpu-pools"
  chart     = local.raw_chart
  namespace = local.sa["karpenter"].namespace

  values = [yamlencode({ manifests = var.gpu_pool_manifests })]

  depends_on = [helm_release.karpenter]
}

resource "helm_release" "nvidia_device_plugin" {
  count = local.use_plugins ? 1 : 0

  name       = "nvidia-device-plugin"
  repository = "https://nvidia.github.io/k8s-device-plugin"
  chart      = "nvidia-device-plugin"
  version    = var.chart_versions.nvidia_device_plugin
  namespace  = "kube-system"

  values = [yamlencode({
    nodeSelector = local.gpu
    tolerations  = local.gpu_taint
    resources = {
      requests = { cpu = "${local.gpu_node_daemonsets["nvidia-device-plugin"].cpu_millis}m", memory = "${local.gpu_node_daemonsets["nvidia-device-plugin"].memory_mib}Mi" }
      limits   = { memory = "128Mi" }
    }
  })]
}

# --- DNS -------------------------------------------------------------------------------------

resource "helm_release" "external_dns" {
  count = local.use_dns ? 1 : 0

  name       = "external-dns"
  repository = "https://kubernetes-sigs.github.io/external-dns/"
  chart      = "external-dns"
  version    = var.chart_versions.external_dns
  namespace  = local.sa["external-dns"].namespace

  values = [yamlencode({
    provider       = { name = "aws" }
    env            = [{ name = "AWS_DEFAULT_REGION", value = var.region }]
    sources        = ["ingress"]
    policy         = "upsert-only" # never deletes a record it did not create
    registry       = "txt"
    txtOwnerId     = var.cluster_name
    domainFilters  = var.external_dns.domain_filters
    serviceAccount = { create = true, name = local.sa["external-dns"].name }
    nodeSelector   = local.system
    resources      = { requests = { cpu = "50m", memory = "64Mi" }, limits = { memory = "128Mi" } }
  })]
}

# --- monitoring ------------------------------------------------------------------------------

resource "helm_release" "kube_prometheus_stack" {
  name       = "kube-prometheus-stack"
  repository = "https://prometheus-community.github.io/helm-charts"
  chart      = "kube-prometheus-stack"
  version    = var.chart_versions.kube_prometheus_stack
  namespace  = kubernetes_namespace_v1.monitoring.metadata[0].name
  wait       = true

  values = [yamlencode({
    grafana = { enabled = false }
    # EKS runs these itself; they cannot be scraped from the cluster.
    kubeControllerManager = { enabled = false }
    kubeScheduler         = { enabled = false }
    kubeEtcd              = { enabled = false }
    kubeProxy             = { enabled = false }
    prometheus = {
      prometheusSpec = {
        # Every ServiceMonitor, PodMonitor and PrometheusRule in the cluster (Tokenmill's too).
        serviceMonitorSelectorNilUsesHelmValues = false
        podMonitorSelectorNilUsesHelmValues     = false
        ruleSelectorNilUsesHelmValues           = false
        retention                               = var.prometheus_retention
        nodeSelector                            = local.system
        resources                               = { requests = { cpu = "500m", memory = "2Gi" }, limits = { memory = "4Gi" } }
      }
    }
    alertmanager = {
      alertmanagerSpec = { nodeSelector = local.system }
    }
    prometheusOperator = { nodeSelector = local.system }
    kube-state-metrics = { nodeSelector = local.system }
    prometheus-node-exporter = {
      tolerations = local.everywhere
      resources = {
        requests = { cpu = "${local.gpu_node_daemonsets["node-exporter"].cpu_millis}m", memory = "${local.gpu_node_daemonsets["node-exporter"].memory_mib}Mi" }
        limits   = { memory = "128Mi" }
      }
    }
  })]
}

resource "helm_release" "dcgm_exporter" {
  name       = "dcgm-exporter"
  repository = "https://nvidia.github.io/dcgm-exporter/helm-charts"
  chart      = "dcgm-exporter"
  version    = var.chart_versions.dcgm_exporter
  namespace  = kubernetes_namespace_v1.monitoring.metadata[0].name

  values = [yamlencode({
    nodeSelector   = local.gpu
    tolerations    = local.gpu_taint
    serviceMonitor = { enabled = true, interval = "15s" }
    resources = {
      requests = { cpu = "${local.gpu_node_daemonsets["dcgm-exporter"].cpu_millis}m", memory = "${local.gpu_node_daemonsets["dcgm-exporter"].memory_mib}Mi" }
      limits   = { memory = "512Mi" }
    }
  })]

  depends_on = [helm_release.kube_prometheus_stack] # its ServiceMonitor's CRD
}

# --- logs ------------------------------------------------------------------------------------

resource "helm_release" "fluent_bit" {
  name       = "fluent-bit"
  repository = "https://fluent.github.io/helm-charts"
  chart      = "fluent-bit"
  version    = var.chart_versions.fluent_bit
  namespace  = kubernetes_namespace_v1.logging.metadata[0].name

  values = [yamlencode({
    serviceAccount = { create = true, name = local.sa["fluent-bit"].name }
    tolerations    = local.everywhere
    resources = {
      requests = { cpu = "${local.gpu_node_daemonsets["fluent-bit"].cpu_millis}m", memory = "${local.gpu_node_daemonsets["fluent-bit"].memory_mib}Mi" }
      limits   = { memory = "256Mi" }
    }
    config = {
      filters = <<-EOT
        [FILTER]
            Name                kubernetes
            Match               kube.*
            Merge_Log           On
            Keep_Log            Off
            K8S-Logging.Parser  On
            K8S-Logging.Exclude On
      EOT
      outputs = <<-EOT
        [OUTPUT]
            Name                cloudwatch_logs
            Match               kube.*
            region              ${var.region}
            log_group_name      ${var.log_group_name}
            log_stream_prefix   ${var.cluster_name}.
            auto_create_group   Off
      EOT
    }
  })]
}

# --- secrets ---------------------------------------------------------------------------------

resource "helm_release" "external_secrets" {
  name       = "external-secrets"
  repository = "https://charts.external-secrets.io"
  chart      = "external-secrets"
  version    = var.chart_versions.external_secrets
  namespace  = kubernetes_namespace_v1.external_secrets.metadata[0].name
  wait       = true

  values = [yamlencode({
    installCRDs    = true
    nodeSelector   = local.system
    resources      = { requests = { cpu = "50m", memory = "128Mi" }, limits = { memory = "256Mi" } }
    webhook        = { nodeSelector = local.system }
    certController = { nodeSelector = local.system }
  })]
}
