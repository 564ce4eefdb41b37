variable "deployment_id" {
  description = "Id of the model deployment (the control plane's deployments row) the workers serve."
  type        = string

  validation {
    condition     = can(regex("^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$", var.deployment_id))
    error_message = "The deployment id becomes a label value: 1-63 letters, digits, '.', '_' or '-'."
  }
}

variable "name" {
  description = "Name of the model deployment; the Kubernetes name tm-worker-<slug> derives from it."
  type        = string
}

variable "model" {
  description = "Model source the worker loads: bundled:smollm2, store:<key> or a path in the image."
  type        = string
}

variable "gpu_type" {
  description = "GPU type the workers run on (the tokenmill.dev/gpu-type node label); null for CPU workers."
  type        = string
  default     = null
}

variable "replicas" {
  description = "Number of workers."
  type        = number
  default     = 1

  validation {
    condition     = var.replicas >= 0 && floor(var.replicas) == var.replicas
    error_message = "replicas must be a whole number, 0 or more."
  }
}

variable "namespace" {
  description = "Namespace of the worker Deployment (TOKENMILL_KUBERNETES_NAMESPACE)."
  type        = string
}

variable "image" {
  description = "Worker container image (TOKENMILL_WORKER_IMAGE)."
  type        = string
}

variable "secret" {
  description = "Secret whose keys become the workers' environment (TOKENMILL_WORKER_SECRET)."
  type        = string
}

variable "cpu" {
  description = "CPU request of a worker (overrides the share); null: gpus x the share's cpu_millis (GPU workers), 2000m (CPU workers)."
  type        = string
  default     = null
}

variable "memory" {
  description = "Memory request and limit of a worker (overrides the share); null: gpus x the share's memory_mib (GPU workers), 8192Mi (CPU workers)."
  type        = string
  default     = null
}

variable "gpus" {
  description = "GPUs of one worker pod (a multi-GPU replica asks gpus x the share)."
  type        = number
  default     = 1

  validation {
    condition     = var.gpus >= 1 && floor(var.gpus) == var.gpus
    error_message = "gpus must be a whole number, 1 or more."
  }
}

variable "share" {
  description = "One GPU's share of a worker pod (TOKENMILL_WORKER_RESOURCES of the GPU type): cpu_millis, memory_mib, ephemeral_gib, model_cache_gib; missing keys take the defaults (3000, 12288, 50, 40)."
  type        = map(number)
  default     = {}

  validation {
    condition     = alltrue([for k in keys(var.share) : contains(["cpu_millis", "memory_mib", "ephemeral_gib", "model_cache_gib"], k)])
    error_message = "share keys are cpu_millis, memory_mib, ephemeral_gib and model_cache_gib."
  }
}

variable "max_stream_seconds" {
  description = "TOKENMILL_MAX_STREAM_SECONDS: the grace period is a minute longer."
  type        = number
  default     = 600
}

variable "engine" {
  description = "Engine of the deployment: builtin (the worker's own) or vllm (vLLM's image beside the worker, as a native sidecar with the GPUs)."
  type        = string
  default     = "builtin"

  validation {
    condition     = contains(["builtin", "vllm"], var.engine)
    error_message = "engine is builtin or vllm."
  }
}

variable "engine_flags" {
  description = "vLLM flags of the deployment's engine arguments, as the autoscaler renders them (autoscaler/kubernetes.py vllm_server_flags), e.g. [\"--tensor-parallel-size\", \"2\"]."
  type        = list(string)
  default     = []
}

variable "engine_args_json" {
  description = "The deployment's engine arguments as TOKENMILL_VLLM_ENGINE_ARGS, for the worker beside vLLM (tokenmill/vllm_args.py encode_engine_args), e.g. {\"tensor_parallel_size\":2}."
  type        = string
  default     = "{}"

  validation {
    condition     = can(tomap(jsondecode(var.engine_args_json)))
    error_message = "engine_args_json must be a JSON object."
  }
}

variable "vllm_image" {
  description = "vLLM's OpenAI server image for vllm deployments (TOKENMILL_VLLM_IMAGE), pinned by sha256 digest."
  type        = string
  default     = null

  validation {
    condition     = var.vllm_image == null || can(regex("^[a-z0-9][^\\s@]*@sha256:[0-9a-f]{64}$", var.vllm_image))
    error_message = "vllm_image must be pinned by digest: name[:tag]@sha256:<64 hex digits>."
  }
}

variable "block_size" {
  description = "Tokens per KV cache block (TOKENMILL_BLOCK_SIZE): the gateways hash prompts in blocks of this size, so the worker's engine (or vLLM's --block-size) uses it too."
  type        = number
  default     = 16

  validation {
    condition     = var.block_size >= 1 && floor(var.block_size) == var.block_size
    error_message = "block_size must be a whole number, 1 or more."
  }
}
