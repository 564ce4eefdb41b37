# The worker Deployment of one model deployment, exactly as the autoscaler's
# KubernetesProvider builds it (autoscaler/kubernetes.py, `worker_manifest`). Pure: no
# provider, no resource, only values, so tests can evaluate it with `terraform console`
# and compare it with the Python side (tests/infra/test_manifests_agree.py).
#
# A vllm deployment's pod runs vLLM's own image beside the worker image: an init container
# (worker image) puts the model into the cache volume and links it, vLLM runs as a native
# sidecar (started before the worker, stopped after it has drained) with the GPUs, on the
# loopback only, and the worker reaches it there.

locals {
  name_prefix = "tm-worker-"
  gpu         = var.gpu_type != null
  vllm        = var.engine == "vllm"

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

  # A vLLM pod: the worker beside vLLM asks this much, vLLM the rest of the pod's share.
  vllm_worker = { cpu_millis = 1000, memory_mib = 2048, ephemeral_gib = 2 }
  worker_size = {
    cpu                 = "${local.vllm_worker.cpu_millis}m"
    memory              = "${local.vllm_worker.memory_mib}Mi"
    "ephemeral-storage" = "${local.vllm_worker.ephemeral_gib}Gi"
  }
  vllm_size = {
    cpu                 = coalesce(var.cpu, "${local.units * local.share.cpu_millis - local.vllm_worker.cpu_millis}m")
    memory              = coalesce(var.memory, "${local.units * local.share.memory_mib - local.vllm_worker.memory_mib}Mi")
    "ephemeral-storage" = "${local.units * local.share.ephemeral_gib - local.vllm_worker.ephemeral_gib}Gi"
  }

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
      # The gateways hash prompts in blocks of this size to route by prefix; the engine's
      # (or vLLM's) blocks must be the same size for its KV events to match.
      { name = "TOKENMILL_BLOCK_SIZE", value = tostring(var.block_size) },
      # The root filesystem is read-only: caches that default to ~ (Triton's, torch's) too.
      { name = "HOME", value = "/var/lib/tokenmill" },
    ],
    [for gpu_type in [var.gpu_type] : { name = "TOKENMILL_GPU_TYPE", value = gpu_type } if gpu_type != null],
    [for entry in local.vllm_env : entry if local.vllm],
  )
  vllm_env = [
    { name = "TOKENMILL_VLLM_URL", value = "http://127.0.0.1:8000" },
    { name = "TOKENMILL_VLLM_KV_EVENTS_ENDPOINT", value = local.kv_events },
    # What the worker sizes its adapter registry and request priorities by.
    { name = "TOKENMILL_VLLM_ENGINE_ARGS", value = var.engine_args_json },
  ]

  ports = [{ name = "http", containerPort = 8080, protocol = "TCP" }]

  # /ready answers without the internal token, once the model is loaded (which may take
  # many minutes: 20 here); /health and every other worker endpoint need the token. Liveness
  # is the port alone: a busy or draining worker is never killed for a slow answer.
  startup_probe   = { httpGet = { path = "/ready", port = "http" }, periodSeconds = 10, failureThreshold = 120 }
  readiness_probe = { httpGet = { path = "/ready", port = "http" }, periodSeconds = 5, failureThreshold = 3 }
  liveness_probe  = { tcpSocket = { port = "http" }, periodSeconds = 10, timeoutSeconds = 5, failureThreshold = 6 }

  # The worker's: the pod's whole size (and its GPUs), or beside vLLM, its own small part.
  builtin_resources = {
    limits = tomap(merge(
      { for k, v in { "nvidia.com/gpu" = tostring(local.gpus) } : k => v if local.gpu },
      { memory = local.memory, "ephemeral-storage" = local.scratch },
    ))
    requests = tomap({ cpu = local.cpu, memory = local.memory, "ephemeral-storage" = local.scratch })
  }
  vllm_worker_resources = {
    limits   = tomap({ memory = local.worker_size.memory, "ephemeral-storage" = local.worker_size["ephemeral-storage"] })
    requests = tomap(local.worker_size)
  }
  resources = local.vllm ? local.vllm_worker_resources : local.builtin_resources

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

  base_volumes = [
    { name = "state", emptyDir = {} },
    { name = "model-cache", emptyDir = { sizeLimit = local.cache } },
    { name = "tmp", emptyDir = {} },
  ]
  vllm_volumes = [
    { name = "vllm-home", emptyDir = {} },
    { name = "vllm-tmp", emptyDir = {} },
    # /dev/shm for vLLM's processes (tensor-parallel NCCL, the engine's queues), in its memory.
    { name = "shm", emptyDir = { medium = "Memory", sizeLimit = "2Gi" } },
    { name = "kv-events", emptyDir = {} },
  ]
  volumes = concat(local.base_volumes, [for volume in local.vllm_volumes : volume if local.vllm])
  base_mounts = [
    { name = "state", mountPath = "/var/lib/tokenmill" },
    { name = "model-cache", mountPath = "/var/lib/tokenmill/models" },
    { name = "tmp", mountPath = "/tmp" },
  ]
  kv_events_mount = { name = "kv-events", mountPath = "/run/tokenmill" }
  volume_mounts   = concat(local.base_mounts, [for mount in [local.kv_events_mount] : mount if local.vllm])

  # --- vLLM: the model link, the pod-local KV events socket, vLLM's health on the loopback ---
  model_link = "/var/lib/tokenmill/models/.vllm-model"
  kv_events  = "ipc:///run/tokenmill/kv-events"
  kv_events_config = jsonencode({
    enable_kv_cache_events = true
    publisher              = "zmq"
    endpoint               = local.kv_events
  })
  # As a worker's own vLLM: llguidance, compact JSON (workers/vllm/server.py).
  structured_outputs_config = jsonencode({ backend = "guidance", disable_any_whitespace = true })
  # Exec, not httpGet: vLLM listens on the loopback only (it checks no key, meters nothing).
  vllm_health = {
    exec           = { command = ["python3", "-c", "import urllib.request as r; r.urlopen('http://127.0.0.1:8000/health', timeout=4)"] }
    periodSeconds  = 10
    timeoutSeconds = 5
  }

  # vLLM's own flags (those a worker gives the vLLM it starts), then the deployment's engine
  # arguments. It checks no key and meters nothing: the loopback only, where the worker beside
  # it reaches it.
  vllm_args = [
    "--model", local.model_link,
    "--host", "127.0.0.1",
    "--port", "8000",
    "--block-size", tostring(var.block_size),
    "--enable-prompt-tokens-details",
    "--kv-events-config", local.kv_events_config,
    "--structured-outputs-config", local.structured_outputs_config,
    "--disable-uvicorn-access-log",
  ]

  init_containers = [
    {
      name            = "fetch-model"
      image           = var.image
      imagePullPolicy = "IfNotPresent"
      command         = ["python", "-m", "workers.fetch_model"]
      args            = [var.model, local.model_link]
      env = [
        { name = "TOKENMILL_HOME", value = "/var/lib/tokenmill" },
        { name = "TOKENMILL_MODEL_CACHE", value = "/var/lib/tokenmill/models" },
        { name = "HOME", value = "/var/lib/tokenmill" },
      ]
      envFrom         = [{ secretRef = { name = var.secret } }]
      resources       = { limits = { memory = local.vllm_size.memory, "ephemeral-storage" = local.vllm_size["ephemeral-storage"] }, requests = local.vllm_size }
      securityContext = local.container_security_context
      volumeMounts    = local.base_mounts
    },
    {
      name            = "vllm"
      image           = var.vllm_image
      imagePullPolicy = "IfNotPresent"
      restartPolicy   = "Always" # a native sidecar
      command         = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
      args            = concat(local.vllm_args, var.engine_flags)
      env = [
        { name = "HOME", value = "/var/lib/vllm" },
        { name = "USER", value = "tokenmill" }, # torch asks getpass; uid 10001 has no name in vLLM's image
        { name = "HF_HUB_OFFLINE", value = "1" },
        { name = "VLLM_NO_USAGE_STATS", value = "1" },
        { name = "VLLM_ALLOW_RUNTIME_LORA_UPDATING", value = "True" },
      ]
      # Big models load for many minutes: 30 here.
      startupProbe  = merge(local.vllm_health, { failureThreshold = 180 })
      livenessProbe = merge(local.vllm_health, { failureThreshold = 6 })
      resources = {
        limits   = { "nvidia.com/gpu" = tostring(local.gpus), memory = local.vllm_size.memory, "ephemeral-storage" = local.vllm_size["ephemeral-storage"] }
        requests = local.vllm_size
      }
      securityContext = local.container_security_context
      volumeMounts = [
        { name = "vllm-home", mountPath = "/var/lib/vllm" },
        { name = "model-cache", mountPath = "/var/lib/tokenmill/models", readOnly = true },
        { name = "vllm-tmp", mountPath = "/tmp" },
        { name = "shm", mountPath = "/dev/shm" },
        local.kv_events_mount,
      ]
    },
  ]

  builtin_worker_args = ["worker", "--model", var.model]
  vllm_worker_args    = ["worker", "--engine", "vllm", "--model", var.model]

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
    args            = local.vllm ? local.vllm_worker_args : local.builtin_worker_args
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
    # The GPU part for GPU deployments, the init containers for vLLM ones.
    concat(
      [for scheduling in [local.gpu_scheduling] : scheduling if local.gpu],
      [for init in [{ initContainers = local.init_containers }] : init if local.vllm],
    )...
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
