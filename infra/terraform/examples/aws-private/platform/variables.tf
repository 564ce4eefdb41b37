variable "infra_state" {
  description = "Where the infra stack's state is (the bucket, key and region of its backend.hcl): this stack reads its outputs."
  type = object({
    bucket = string
    key    = string
    region = string
  })
}

variable "image" {
  description = "Services image (built from Dockerfile and pushed to your registry), with a version tag or digest."
  type        = string

  validation {
    condition     = can(regex("(:[A-Za-z0-9_][A-Za-z0-9_.-]*|@sha256:[0-9a-f]{64})$", var.image)) && !endswith(var.image, ":latest")
    error_message = "image must carry a version tag or a digest, not :latest."
  }
}

variable "worker_image" {
  description = "GPU worker image (built from Dockerfile.worker), with a version tag or digest."
  type        = string

  validation {
    condition     = can(regex("(:[A-Za-z0-9_][A-Za-z0-9_.-]*|@sha256:[0-9a-f]{64})$", var.worker_image)) && !endswith(var.worker_image, ":latest")
    error_message = "worker_image must carry a version tag or a digest, not :latest."
  }
}

variable "vllm_image" {
  description = "vLLM's OpenAI server image for vllm deployments, pinned by digest (e.g. mirrored into your ECR); null: the tokenmill module's default (vllm/vllm-openai from Docker Hub)."
  type        = string
  default     = null

  validation {
    condition     = var.vllm_image == null || can(regex("^[a-z0-9][^\\s@]*@sha256:[0-9a-f]{64}$", var.vllm_image))
    error_message = "vllm_image must be pinned by digest: name[:tag]@sha256:<64 hex digits>."
  }
}

variable "api_host" {
  description = "Public host name of the API (e.g. api.example.com); null: no load balancer."
  type        = string
  default     = null
}

variable "admin_host" {
  description = "Host name of the admin API and dashboard, on an internal load balancer; null: none (use kubectl port-forward)."
  type        = string
  default     = null
}

variable "certificate_arn" {
  description = "ACM certificate covering api_host and admin_host (required with either)."
  type        = string
  default     = null

  validation {
    condition     = var.certificate_arn == null || can(regex("^arn:aws[a-z-]*:acm:[a-z0-9-]+:[0-9]{12}:certificate/", coalesce(var.certificate_arn, "x")))
    error_message = "certificate_arn must be an ACM certificate ARN."
  }
}

variable "api_allowed_cidrs" {
  description = "CIDR blocks allowed to reach the public API load balancer."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "gpu_pools" {
  description = <<-EOT
    GPU node pools by GPU type (the price book's name of the GPU, and a deployment's gpu_type):
    the EC2 instance types Karpenter may launch for it (one GPU model each; modules/worker-sizing
    knows their sizes), the nodes' data volume, capacity types, the most GPUs the pool may hold
    at once, and optionally one GPU's share of a worker pod (else the largest every type fits).
    The plan fails when a worker would not fit.
  EOT
  type = map(object({
    instance_types = list(string)
    disk_gib       = optional(number, 200)
    capacity_types = optional(list(string), ["on-demand"])
    max_gpus       = optional(number, 8)
    share = optional(object({
      cpu_millis      = optional(number)
      memory_mib      = optional(number)
      ephemeral_gib   = optional(number)
      model_cache_gib = optional(number)
    }), {})
  }))
  default = {
    a10g = { instance_types = ["g5.2xlarge"], max_gpus = 4 }
  }
}

variable "gpu_ami" {
  description = "The GPU nodes' AMI: bottlerocket (NVIDIA variant, device plugin built in) or al2023, and its pinned release (Bottlerocket v1.x.y, AL2023 vYYYYMMDD) with an NVIDIA driver 580 or newer (CUDA 13)."
  type = object({
    family  = optional(string, "bottlerocket")
    version = string
  })
}

variable "max_stream_seconds" {
  description = "TOKENMILL_MAX_STREAM_SECONDS: the longest a stream may run; the ALB idle timeout and deregistration delay and the pods' preStop, graceful shutdown and grace period follow from it."
  type        = number
  default     = 600
}

variable "dns_domains" {
  description = "Domains external-dns may write the API and admin records in (when the infra stack was given route53_zone_ids)."
  type        = list(string)
  default     = []
}

variable "tokenmill_settings" {
  description = "Further TOKENMILL_* settings of the services (see the README's settings table)."
  type        = map(string)
  default     = {}
}

