variable "cluster_name" {
  description = "Name of the EKS cluster (subnets and security groups are found by its karpenter.sh/discovery tag)."
  type        = string
}

variable "node_role_name" {
  description = "IAM role of the GPU nodes (modules/addons-aws karpenter_node_role_name)."
  type        = string
}

variable "pools" {
  description = "GPU node pools by GPU type (the tokenmill.dev/gpu-type label): instance types Karpenter may launch, the data volume in GiB, ON_DEMAND and/or SPOT capacity, and the most GPUs the pool may hold at once."
  type = map(object({
    instance_types = list(string)
    disk_gib       = optional(number, 200)
    capacity_types = optional(list(string), ["on-demand"])
    max_gpus       = optional(number, 8)
  }))

  validation {
    condition     = alltrue([for p in values(var.pools) : length(p.capacity_types) > 0 && alltrue([for c in p.capacity_types : contains(["on-demand", "spot"], c)])])
    error_message = "capacity_types are on-demand and/or spot."
  }

  validation {
    condition     = alltrue([for p in values(var.pools) : p.disk_gib >= 50 && p.max_gpus >= 1])
    error_message = "Each pool needs a data volume of 50 GiB or more and max_gpus of 1 or more."
  }
}

variable "ami_family" {
  description = "bottlerocket (NVIDIA variant: driver, container toolkit and device plugin built in) or al2023 (EKS's NVIDIA AMI; modules/addons then installs the NVIDIA device plugin)."
  type        = string
  default     = "bottlerocket"

  validation {
    condition     = contains(["bottlerocket", "al2023"], var.ami_family)
    error_message = "ami_family must be bottlerocket or al2023."
  }
}

variable "ami_version" {
  description = <<-EOT
    The pinned AMI release of the GPU nodes (Karpenter's amiSelectorTerms alias): a Bottlerocket
    version such as v1.51.0, or an AL2023 release such as v20251120. It must ship an NVIDIA
    driver 580 or newer (the worker image's CUDA 13). Nodes change only when this does. Find the
    current one: aws ssm get-parameter --name /aws/service/bottlerocket/aws-k8s-<version>-nvidia/x86_64/latest/image_version
  EOT
  type        = string

  validation {
    condition     = can(regex("^v[0-9]+(\\.[0-9]+\\.[0-9]+|[0-9]{7})$", var.ami_version)) && var.ami_version != "latest"
    error_message = "ami_version must be a pinned release (v1.51.0 for Bottlerocket, v20251120 for AL2023), not latest."
  }
}

variable "max_pods" {
  description = "kubelet maxPods of the GPU nodes (only workers and DaemonSets run there); modules/worker-sizing counts the memory the kubelet reserves for it."
  type        = number
  default     = 32
}

variable "tags" {
  description = "Tags of the EC2 instances and volumes Karpenter launches."
  type        = map(string)
  default     = {}
}
