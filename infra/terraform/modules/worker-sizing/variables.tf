variable "pools" {
  description = <<-EOT
    GPU node pools by GPU type (the tokenmill.dev/gpu-type label and a deployment's gpu_type):
    the EC2 instance types Karpenter may launch for it (all with the same GPU, all in
    instance-types.json), the node's data volume in GiB, and optionally one GPU's share of a
    worker pod (cpu_millis, memory_mib, ephemeral_gib, model_cache_gib) instead of the largest
    share every instance type of the pool fits.
  EOT
  type = map(object({
    instance_types = list(string)
    disk_gib       = optional(number, 200)
    share = optional(object({
      cpu_millis      = optional(number)
      memory_mib      = optional(number)
      ephemeral_gib   = optional(number)
      model_cache_gib = optional(number)
    }), {})
  }))

  validation {
    condition     = length(var.pools) > 0 && alltrue([for t, p in var.pools : length(p.instance_types) > 0 && can(regex("^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$", t)) && t != "cpu"])
    error_message = "Give at least one pool, named as a label value (not cpu), each with instance types."
  }
}

variable "daemonset_requests" {
  description = "What the DaemonSets on a GPU node request together (VPC CNI, kube-proxy, Pod Identity agent, dcgm-exporter, node-exporter, Fluent Bit, device plugin); modules/addons outputs its own sum."
  type = object({
    cpu_millis = number
    memory_mib = number
  })
  default = { cpu_millis = 600, memory_mib = 1024 }
}

variable "max_pods" {
  description = "kubelet maxPods of the GPU nodes (the EC2NodeClass sets it): the kube-reserved memory grows with it (255 MiB + 11 MiB a pod)."
  type        = number
  default     = 32
}

variable "image_gib" {
  description = "Room kept on a GPU node's data volume for container images (the worker image with torch's CUDA wheels is about 15 GiB unpacked) and logs."
  type        = number
  default     = 40
}

variable "model_cache_percent" {
  description = "Part of a worker's ephemeral storage (by default) for its model cache volume; the rest is scratch (Triton's cache, temporary files)."
  type        = number
  default     = 75

  validation {
    condition     = var.model_cache_percent > 0 && var.model_cache_percent < 100
    error_message = "model_cache_percent must be between 1 and 99."
  }
}
