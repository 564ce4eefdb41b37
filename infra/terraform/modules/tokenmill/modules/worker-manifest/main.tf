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

  # One GPU's share (TOKENMILL_WORKER_RESOURCES of its type, else the default); a pod with n
  # GPUs asks n times it. A CPU worker has a size of its own.
  default_gpu_share = { cpu_millis = 3000, memory_mib = 12288, ephemeral_gib = 50, model_cache_gib = 40 }
  cpu_worker        = { cpu_millis = 2000, memory_mib = 8192, ephemeral_gib = 20, model_cache_gib = 10 }
  share             = local.gpu ? merge(local.default_gpu_share, var.share) : local.cpu_worker
  gpus              = local.gpu ? var.gpus : 0
  units             = max(local.gpus, 1)

  cpu     = coalesce(var.cpu, "${local.units * local.share.cpu_millis}m")
  memory  = coalesce(var.memory, "${local.units * local.share.memory_mib}Mi")
  scratch = "${local.units * local.share.ephemeral_gib}Gi" # the model cache is part of it
  cache   = "${local.units * local.share.model_cache_gib}Gi"

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
      { name = "TOKENMILL_MODEL_CACHE", value = "/var/lib/tokenmill/models" },
      { name = "TOKENMILL_MAX_STREAM_SECONDS", value = tostring(var.max_stream_seconds) },
      # The root filesystem is read-only: caches that default to ~ (Triton's, torch's) too.
      { name = "HOME", value = "/var/lib/tokenmill" },
    ],
    [for gpu_type in [var.gpu_type] : { name = "TOKENMILL_GPU_TYPE", value = gpu_type } if gpu_type != null],
  )

  ports = [{ name = "http", containerPort = 8080, protocol = "TCP" }]

  # /ready answers without the internal token, once the model is loaded (which may take
  # many minutes: 20 here); /health and every other worker endpoint need the token. Liveness
  # is the port alone: a busy or draining worker is never killed for a slow answer.
  startup_probe   = { httpGet = { path = "/ready", port = "http" }, periodSeconds = 10, failureThreshold = 120 }
  readiness_probe = { httpGet = { path = "/ready", port = "http" }, periodSeconds = 5, failureThreshold = 3 }
  liveness_probe  = { tcpSocket = { port = "http" }, periodSeconds = 10, timeoutSeconds = 5, failureThreshold = 6 }

  resources = {
    limits = merge(
      { for k, v in { "nvidia.com/gpu" = tostring(local.gpus) } : k => v if local.gpu },
      { memory = local.memory, "ephemeral-storage" = local.scratch },
    )
    requests = { cpu = local.cpu, memory = local.memory, "ephemeral-storage" = local.scratch }
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
    { name = "model-cache", emptyDir = { sizeLimit = local.cache } },
    { name = "tmp", emptyDir = {} },
  ]
  volume_mounts = [
    { name = "state", mountPath = "/var/lib/tokenmill" },
    { name = "model-cache", mountPath = "/var/lib/tokenmill/models" },
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
      serviceAccountName           = "tokenmill-worker"
      automountServiceAccountToken = false
      priorityClassName            = "tokenmill-worker"
      # The longest stream a gateway lets run, and a minute to say goodbye on the bus.
      terminationGracePeriodSeconds = var.max_stream_seconds + 60
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

  # Beside it (same name): voluntary disruptions take one of its workers at a time.
  disruption_budget = {
    apiVersion = "policy/v1"
    kind       = "PodDisruptionBudget"
    metadata   = { name = local.name, namespace = var.namespace, labels = local.labels }
    spec = {
      maxUnavailable             = 1
      selector                   = { matchLabels = local.selector }
      unhealthyPodEvictionPolicy = "AlwaysAllow"
    }
  }
}
