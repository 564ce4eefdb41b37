# The worker Deployment of one model deployment, exactly as the autoscaler's
# KubernetesProvider builds it (autoscaler/kubernetes.py, `worker_manifest`). Pure: no
# provider, no resource, only values, so tests can evaluate it with `terraform console`
# and compare it with the Python side (tests/infra/test_manifests_agree.py).

locals {
  name_prefix = "tm-worker-"
  gpu         = var.gpu_type != null

  slug   = trim(replace(lower(var.name), "/[^a-z0-9]+/", "-"), "-")
  digest = substr(sha256(var.deployment_id), 0, 8)
  # tm-worker-<slug>, at most 63 characters; a long or empty slug gets a hash suffix.
  name = (
    local.slug != "" && length(local.name_prefix) + length(local.slug) <= 63
    ? "${local.name_prefix}${local.slug}"
    : (
      local.slug != ""
      ? "${local.name_prefix}${substr(local.slug, 0, 63 - length(local.name_prefix) - 9)}-${local.digest}"
      : "${local.name_prefix}${local.digest}"
    )
  )

  cpu    = coalesce(var.cpu, local.gpu ? "4" : "2")
  memory = coalesce(var.memory, local.gpu ? "32Gi" : "8Gi")

  labels = {
    "app.kubernetes.io/name"       = "tokenmill-worker"
    "app.kubernetes.io/part-of"    = "tokenmill"
    "app.kubernetes.io/component"  = "worker"
    "app.kubernetes.io/managed-by" = "tokenmill-autoscaler"
    "tokenmill.dev/deployment"     = var.deployment_id
  }
  selector = {
    "app.kubernetes.io/name"   = "tokenmill-worker"
    "tokenmill.dev/deployment" = var.deployment_id
  }

  env = concat(
    [
      { name = "TOKENMILL_DEPLOYMENT_ID", value = var.deployment_id },
      { name = "TOKENMILL_WORKER_ID", valueFrom = { fieldRef = { fieldPath = "metadata.name" } } },
      { name = "TOKENMILL_WORKER_ADVERTISE_HOST", valueFrom = { fieldRef = { fieldPath = "status.podIP" } } },
      { name = "TOKENMILL_WORKER_HOST", value = "0.0.0.0" },
      { name = "TOKENMILL_WORKER_PORT", value = "8080" },
      { name = "TOKENMILL_HOME", value = "/var/lib/tokenmill" },
      # The root filesystem is read-only: caches that default to ~ (Triton's, torch's) too.
      { name = "HOME", value = "/var/lib/tokenmill" },
    ],
    [for gpu_type in [var.gpu_type] : { name = "TOKENMILL_GPU_TYPE", value = gpu_type } if gpu_type != null],
  )

  ports = [{ name = "http", containerPort = 8080, protocol = "TCP" }]

  # /ready answers without the internal token, once the model is loaded (which may take
  # minutes); /health and every other worker endpoint need the token.
  startup_probe   = { httpGet = { path = "/ready", port = "http" }, periodSeconds = 10, failureThreshold = 60 }
  readiness_probe = { httpGet = { path = "/ready", port = "http" }, periodSeconds = 5, failureThreshold = 3 }
  liveness_probe  = { httpGet = { path = "/ready", port = "http" }, periodSeconds = 10, failureThreshold = 6 }

  resources = {
    limits   = merge({ for k, v in { "nvidia.com/gpu" = "1" } : k => v if local.gpu }, { memory = local.memory })
    requests = { cpu = local.cpu, memory = local.memory }
  }

  container_security_context = {
    allowPrivilegeEscalation = false
    readOnlyRootFilesystem   = true
    capabilities             = { drop = ["ALL"] }
  }
  pod_security_context = {
    runAsNonRoot   = true
    runAsUser      = 10001
    fsGroup        = 10001
    seccompProfile = { type = "RuntimeDefault" }
  }

  volumes = [
    { name = "state", emptyDir = {} },
    { name = "tmp", emptyDir = {} },
  ]
  volume_mounts = [
    { name = "state", mountPath = "/var/lib/tokenmill" },
    { name = "tmp", mountPath = "/tmp" },
  ]

  # GPU nodes carry this label and taint (modules/cluster).
  gpu_scheduling = {
    nodeSelector = { "tokenmill.dev/gpu-type" = var.gpu_type }
    tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  }

  container = {
    name            = "worker"
    image           = var.image
    imagePullPolicy = "IfNotPresent"
    command         = ["tokenmill"]
    args            = ["worker", "--model", var.model]
    env             = local.env
    envFrom         = [{ secretRef = { name = var.secret } }]
    ports           = local.ports
    startupProbe    = local.startup_probe
    readinessProbe  = local.readiness_probe
    livenessProbe   = local.liveness_probe
    resources       = local.resources
    securityContext = local.container_security_context
    volumeMounts    = local.volume_mounts
  }

  pod_spec = merge(
    {
      serviceAccountName            = "tokenmill-worker"
      automountServiceAccountToken  = false
      terminationGracePeriodSeconds = 600
      securityContext               = local.pod_security_context
      containers                    = [local.container]
      volumes                       = local.volumes
    },
    [for scheduling in [local.gpu_scheduling] : scheduling if local.gpu]...
  )

  pod_template = {
    metadata = { labels = local.labels }
    spec     = local.pod_spec
  }

  manifest = {
    apiVersion = "apps/v1"
    kind       = "Deployment"
    metadata = {
      name      = local.name
      namespace = var.namespace
      labels    = local.labels
      # Compact JSON with sorted keys, as the provider hashes it: a changed model or image
      # changes the hash and the autoscaler replaces the Deployment.
      annotations = { "tokenmill.dev/spec-hash" = substr(sha256(jsonencode(local.pod_template)), 0, 16) }
    }
    spec = {
      replicas = var.replicas
      selector = { matchLabels = local.selector }
      template = local.pod_template
    }
  }
}
