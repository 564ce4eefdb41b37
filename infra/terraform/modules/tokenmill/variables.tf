variable "namespace" {
  description = "Namespace of every Tokenmill object, the worker Deployments included (TOKENMILL_KUBERNETES_NAMESPACE)."
  type        = string
  default     = "tokenmill"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.namespace)) && !contains(["default", "kube-system", "kube-public"], var.namespace)
    error_message = "namespace must be a DNS label of its own (not default or kube-*)."
  }
}

variable "image" {
  description = "Image of the services (Dockerfile): repository with a version tag or a digest, never :latest."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][^\\s@]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})$", var.image)) && !endswith(var.image, ":latest")
    error_message = "image must name a version tag or a sha256 digest, not :latest."
  }
}

variable "worker_image" {
  description = "Image of the GPU workers (Dockerfile.worker; TOKENMILL_WORKER_IMAGE): a version tag or a digest, never :latest."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][^\\s@]*(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})$", var.worker_image)) && !endswith(var.worker_image, ":latest")
    error_message = "worker_image must name a version tag or a sha256 digest, not :latest."
  }
}

variable "vllm_image" {
  description = "vLLM's OpenAI server image (TOKENMILL_VLLM_IMAGE), pinned by sha256 digest: it runs beside the worker image in the pods of vllm deployments. Mirror it into your own registry to avoid Docker Hub's pull limits; null: the default below."
  type        = string
  default     = "vllm/vllm-openai:v0.31.0@sha256:c1c9f6fd5c109ba7f0546a59f5b2f15fb87f64c77782e90a27b648b42a8e67c3"
  nullable    = false

  validation {
    condition     = can(regex("^[a-z0-9][^\\s@]*@sha256:[0-9a-f]{64}$", var.vllm_image))
    error_message = "vllm_image must be pinned by digest: name[:tag]@sha256:<64 hex digits>."
  }
}

variable "image_pull_policy" {
  description = "Pull policy of the service containers (workers always use IfNotPresent: their images are large)."
  type        = string
  default     = "Always"

  validation {
    condition     = contains(["Always", "IfNotPresent"], var.image_pull_policy)
    error_message = "image_pull_policy must be Always or IfNotPresent."
  }
}

# --- secrets: Secrets Manager, through External Secrets --------------------------------

variable "secret_store" {
  description = "Where External Secrets reads Secrets Manager from: the region and the IAM role of the tokenmill-secrets service account (modules/secrets reader_role_arn)."
  type = object({
    region   = string
    role_arn = string
  })

  validation {
    condition     = can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:role/", var.secret_store.role_arn))
    error_message = "secret_store.role_arn must be an IAM role ARN."
  }
}

variable "secrets" {
  description = "Names (or ARNs) in Secrets Manager of Tokenmill's secrets (modules/secrets secret_names): internal_token, worker_token, secret_key, database_app (JSON username, password) and stripe (JSON of TOKENMILL_STRIPE_* keys)."
  type = object({
    internal_token = string
    worker_token   = string
    secret_key     = string
    database_app   = string
    stripe         = string
  })
}

variable "database" {
  description = "PostgreSQL: host, port, database, and the Secrets Manager secret of the owner the migrations run as (RDS's master user secret, JSON username, password)."
  type = object({
    address      = string
    port         = number
    name         = string
    owner_secret = string
  })
}

variable "redis" {
  description = "Redis (TLS): the primary endpoint, the port, and the Secrets Manager secret of each component's Redis user (modules/cache user_secret_arns: gateway, control-plane, billing, autoscaler, worker)."
  type = object({
    endpoint     = string
    port         = number
    user_secrets = map(string)
  })

  validation {
    condition     = alltrue([for user in ["gateway", "control-plane", "billing", "autoscaler", "worker"] : contains(keys(var.redis.user_secrets), user)])
    error_message = "redis.user_secrets needs the users gateway, control-plane, billing, autoscaler and worker."
  }
}

variable "secret_refresh_interval" {
  description = "How often External Secrets re-reads Secrets Manager (a rotated value reaches the Secrets then; pods read it when they restart)."
  type        = string
  default     = "1h"
}

variable "storage_url" {
  description = "TOKENMILL_STORAGE_URL: s3://bucket/prefix of weights, adapters and exports."
  type        = string

  validation {
    condition     = can(regex("^s3://[a-z0-9][a-z0-9.-]+[a-z0-9](/.*)?$", var.storage_url))
    error_message = "storage_url must be an s3://bucket/prefix URL."
  }
}

variable "s3_region" {
  description = "TOKENMILL_S3_REGION: region of the bucket; null: boto3's default."
  type        = string
  default     = null
}

# --- IAM roles for service accounts (modules/storage outputs) --------------------------

variable "writer_role_arn" {
  description = "IAM role of the control plane and Celery service accounts (read and write the bucket); null: no IRSA annotation."
  type        = string
  default     = null
}

variable "files_writer_role_arn" {
  description = "IAM role of the gateway service account (read the bucket, write only under its files/: the uploads of /v1/files); null: no IRSA annotation."
  type        = string
  default     = null
}

variable "reader_role_arn" {
  description = "IAM role of the worker service account (read the bucket); null: no IRSA annotation."
  type        = string
  default     = null
}

# --- sizes ------------------------------------------------------------------------------

variable "gateway_replicas" {
  description = "Bounds of the gateway's HorizontalPodAutoscaler and its CPU utilisation target (percent of the request)."
  type = object({
    min                = optional(number, 2)
    max                = optional(number, 20)
    target_utilization = optional(number, 70)
  })
  default = {}

  validation {
    condition     = var.gateway_replicas.min >= 1 && var.gateway_replicas.min <= var.gateway_replicas.max && var.gateway_replicas.target_utilization > 0 && var.gateway_replicas.target_utilization <= 100
    error_message = "gateway_replicas needs 1 <= min <= max and a target between 1 and 100."
  }
}

variable "control_plane_replicas" {
  description = "Replicas of the control plane (admin API and ledger consumers)."
  type        = number
  default     = 2

  validation {
    condition     = var.control_plane_replicas >= 1
    error_message = "control_plane_replicas must be at least 1."
  }
}

variable "celery_worker_replicas" {
  description = "Replicas of the Celery worker running the billing jobs (beat always runs exactly one)."
  type        = number
  default     = 2

  validation {
    condition     = var.celery_worker_replicas >= 1
    error_message = "celery_worker_replicas must be at least 1."
  }
}

variable "celery_concurrency" {
  description = "Job processes of each Celery worker."
  type        = number
  default     = 2

  validation {
    condition     = var.celery_concurrency >= 1
    error_message = "celery_concurrency must be at least 1."
  }
}

variable "autoscaler_replicas" {
  description = "Replicas of the worker autoscaler; a Redis lease lets one act at a time, the others stand by. 0 turns it off (workers are then started by hand, from the worker templates)."
  type        = number
  default     = 2

  validation {
    condition     = var.autoscaler_replicas >= 0 && var.autoscaler_replicas <= 3
    error_message = "autoscaler_replicas must be between 0 and 3."
  }
}

variable "resources" {
  description = "CPU request and limit and memory (request = limit) of each service container."
  type = object({
    gateway       = optional(object({ cpu = string, cpu_limit = string, memory = string }), { cpu = "1", cpu_limit = "2", memory = "2Gi" })
    control_plane = optional(object({ cpu = string, cpu_limit = string, memory = string }), { cpu = "500m", cpu_limit = "2", memory = "1Gi" })
    celery_worker = optional(object({ cpu = string, cpu_limit = string, memory = string }), { cpu = "500m", cpu_limit = "2", memory = "1Gi" })
    celery_beat   = optional(object({ cpu = string, cpu_limit = string, memory = string }), { cpu = "100m", cpu_limit = "500m", memory = "512Mi" })
    autoscaler    = optional(object({ cpu = string, cpu_limit = string, memory = string }), { cpu = "200m", cpu_limit = "1", memory = "512Mi" })
    migrate       = optional(object({ cpu = string, cpu_limit = string, memory = string }), { cpu = "200m", cpu_limit = "1", memory = "512Mi" })
  })
  default = {
    gateway       = { cpu = "1", cpu_limit = "2", memory = "2Gi" }
    control_plane = { cpu = "500m", cpu_limit = "2", memory = "1Gi" }
    celery_worker = { cpu = "500m", cpu_limit = "2", memory = "1Gi" }
    celery_beat   = { cpu = "100m", cpu_limit = "500m", memory = "512Mi" }
    autoscaler    = { cpu = "200m", cpu_limit = "1", memory = "512Mi" }
    migrate       = { cpu = "200m", cpu_limit = "1", memory = "512Mi" }
  }
}

# --- workers ----------------------------------------------------------------------------

variable "worker_gpu_types" {
  description = "GPU types of the cluster's GPU node groups (modules/cluster output gpu_types): the ConfigMap tokenmill-worker-templates holds, per type (builtin, and vllm-<type> for vLLM) and for CPU, the Deployment the autoscaler creates for a model deployment."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for t in var.worker_gpu_types : can(regex("^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$", t)) && t != "cpu"])
    error_message = "worker_gpu_types must be label values (lower-case) other than \"cpu\"."
  }
}

variable "worker_resources" {
  description = "TOKENMILL_WORKER_RESOURCES: one GPU's share of a worker pod per GPU type (modules/worker-sizing worker_resources: cpu_millis, memory_mib, ephemeral_gib, model_cache_gib)."
  type        = map(map(number))
  default     = {}
}

variable "max_stream_seconds" {
  description = "TOKENMILL_MAX_STREAM_SECONDS: the longest a stream may run; the ALB's deregistration delay, the pods' preStop, graceful shutdown and grace period follow from it (modules/rollout)."
  type        = number
  default     = 600
}

variable "monitoring" {
  description = "Create the PodMonitors and alert rules (needs the Prometheus operator's CRDs: modules/addons)."
  type        = bool
  default     = true
}

variable "worker_template_model" {
  description = "Model source written into the worker templates (replace it when applying one by hand)."
  type        = string
  default     = "bundled:smollm2"
}

variable "monitoring_namespace" {
  description = "Namespace of a Prometheus allowed to scrape the workers' /metrics; null: none."
  type        = string
  default     = null
}

variable "network_policies" {
  description = "Admit traffic to workers from Tokenmill's own pods only (needs NetworkPolicy enforcement, which the cluster module turns on in the VPC CNI)."
  type        = bool
  default     = true
}

# --- exposure ---------------------------------------------------------------------------

variable "ingress_class_name" {
  description = "IngressClass of the Ingresses (alb: the AWS Load Balancer Controller)."
  type        = string
  default     = "alb"
}

variable "api_host" {
  description = "Host name of the public API: /v1 goes to the gateways, /webhooks/stripe to the control plane; null: no Ingress."
  type        = string
  default     = null
}

variable "api_ingress_annotations" {
  description = "Annotations of the API Ingress (load balancer scheme, certificate, TLS policy...)."
  type        = map(string)
  default     = {}
}

variable "admin_host" {
  description = "Host name of the admin API and dashboard (the control plane); null: no Ingress (reach it with kubectl port-forward)."
  type        = string
  default     = null
}

variable "admin_ingress_annotations" {
  description = "Annotations of the admin Ingress; keep it on an internal load balancer."
  type        = map(string)
  default     = {}
}

variable "tls_secret_name" {
  description = "Secret with the TLS certificate of both hosts, for ingress controllers that terminate TLS themselves; null: the load balancer terminates it (e.g. an ACM certificate in the annotations)."
  type        = string
  default     = null
}

# --- settings ---------------------------------------------------------------------------

variable "log_level" {
  description = "TOKENMILL_LOG_LEVEL of every process."
  type        = string
  default     = "INFO"

  validation {
    condition     = contains(["DEBUG", "INFO", "WARNING", "ERROR"], var.log_level)
    error_message = "log_level must be DEBUG, INFO, WARNING or ERROR."
  }
}

variable "settings" {
  description = "Further non-secret settings of the services, e.g. { TOKENMILL_ROUTING = \"prefix\" } (see the README's settings table)."
  type        = map(string)
  default     = {}

  validation {
    condition = alltrue([
      for k in keys(var.settings) : startswith(k, "TOKENMILL_") && !contains([
        "TOKENMILL_INTERNAL_TOKEN", "TOKENMILL_WORKER_TOKEN", "TOKENMILL_SECRET_KEY", "TOKENMILL_CELERY_BROKER_URL",
        "TOKENMILL_STRIPE_API_KEY", "TOKENMILL_STRIPE_WEBHOOK_SECRET", "TOKENMILL_APP_DATABASE_URL",
        "TOKENMILL_MAX_STREAM_SECONDS", "TOKENMILL_SHUTDOWN_GRACE_SECONDS", "TOKENMILL_WORKER_RESOURCES",
        "TOKENMILL_VLLM_IMAGE",
      ], k)
    ])
    error_message = "settings keys must be TOKENMILL_* environment variables, no secret (Secrets Manager holds them) and none of those with a variable of their own (max_stream_seconds, worker_resources, vllm_image)."
  }
}

variable "migration_timeout" {
  description = "How long the apply waits for the migration Job before failing (the rollout waits for it)."
  type        = string
  default     = "15m"
}
