variable "name" {
  description = "Name of the EKS cluster (and prefix of its other resources)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "kubernetes_version" {
  description = "Kubernetes minor version of the control plane and the node groups."
  type        = string
  default     = "1.34"

  validation {
    condition     = can(regex("^1\\.(29|3[0-9])$", var.kubernetes_version))
    error_message = "kubernetes_version must be a supported EKS minor version such as 1.34."
  }
}

variable "subnet_ids" {
  description = "Private subnets of the control plane's network interfaces and of every node group."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "EKS needs subnets in at least two availability zones."
  }
}

variable "endpoint_public_access" {
  description = "Whether the Kubernetes API is reachable from the internet (from public_access_cidrs only); off by default: reach it from the VPC (VPN, bastion, CI runner inside)."
  type        = bool
  default     = false
}

variable "public_access_cidrs" {
  description = "CIDR blocks allowed to reach the public Kubernetes API endpoint when it is on."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for cidr in var.public_access_cidrs : can(cidrhost(cidr, 0)) && cidr != "0.0.0.0/0"])
    error_message = "public_access_cidrs must be CIDR blocks, and not 0.0.0.0/0."
  }
}

variable "grant_creator_admin" {
  description = "Give the identity that creates the cluster (the one running Terraform) cluster-admin access, so the same apply can create the Kubernetes resources."
  type        = bool
  default     = true
}

variable "admin_principal_arns" {
  description = "IAM roles or users given cluster-admin access (EKS access entries)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for arn in var.admin_principal_arns : can(regex("^arn:aws[a-z-]*:iam::[0-9]{12}:(role|user)/", arn))])
    error_message = "admin_principal_arns must be IAM role or user ARNs."
  }
}

variable "system_node_group" {
  description = "The node group of the services (gateway, control plane, Celery, autoscaler) and cluster add-ons."
  type = object({
    instance_types = optional(list(string), ["m7i.xlarge"])
    min_size       = optional(number, 2)
    max_size       = optional(number, 6)
    desired_size   = optional(number, 3)
    disk_size_gib  = optional(number, 50)
  })
  default = {}

  validation {
    condition     = var.system_node_group.min_size >= 1 && var.system_node_group.min_size <= var.system_node_group.desired_size && var.system_node_group.desired_size <= var.system_node_group.max_size
    error_message = "The system node group needs 1 <= min_size <= desired_size <= max_size."
  }
}

variable "gpu_node_groups" {
  description = <<-EOT
    GPU node groups by name. Each group's nodes are labelled tokenmill.dev/gpu-type=<gpu_type>
    (the worker pods' nodeSelector) and tainted nvidia.com/gpu=present:NoSchedule (tolerated by
    worker pods only). gpu_type is the name the price book uses (a10g, l4, h100...).
    Bottlerocket NVIDIA images ship the NVIDIA device plugin; the AL2023/AL2 GPU images need
    it installed separately.
  EOT
  type = map(object({
    gpu_type       = string
    instance_types = list(string)
    min_size       = optional(number, 0)
    max_size       = optional(number, 4)
    desired_size   = optional(number, 0)
    disk_size_gib  = optional(number, 200)
    ami_type       = optional(string, "BOTTLEROCKET_x86_64_NVIDIA")
    capacity_type  = optional(string, "ON_DEMAND")
  }))
  default = {}

  validation {
    condition     = alltrue([for g in values(var.gpu_node_groups) : can(regex("^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$", g.gpu_type))])
    error_message = "gpu_type becomes a label value: lower-case letters, digits, '.', '_' or '-', at most 63."
  }

  validation {
    condition     = alltrue([for g in values(var.gpu_node_groups) : contains(["BOTTLEROCKET_x86_64_NVIDIA", "BOTTLEROCKET_ARM_64_NVIDIA", "AL2023_x86_64_NVIDIA", "AL2_x86_64_GPU"], g.ami_type)])
    error_message = "ami_type must be a GPU image: BOTTLEROCKET_x86_64_NVIDIA, BOTTLEROCKET_ARM_64_NVIDIA, AL2023_x86_64_NVIDIA or AL2_x86_64_GPU."
  }

  validation {
    condition     = alltrue([for g in values(var.gpu_node_groups) : contains(["ON_DEMAND", "SPOT"], g.capacity_type)])
    error_message = "capacity_type must be ON_DEMAND or SPOT."
  }

  validation {
    condition     = alltrue([for g in values(var.gpu_node_groups) : g.min_size >= 0 && g.min_size <= g.desired_size && g.desired_size <= g.max_size && g.max_size >= 1])
    error_message = "Each GPU node group needs 0 <= min_size <= desired_size <= max_size, max_size >= 1."
  }
}

variable "addons" {
  description = "EKS add-ons besides vpc-cni (always installed), by name, with an optional version (null: the default for the cluster version). metrics-server feeds the gateway's autoscaler."
  type = map(object({
    version = optional(string)
  }))
  default = {
    coredns        = {}
    kube-proxy     = {}
    metrics-server = {}
  }
}

variable "log_retention_days" {
  description = "Days the control plane logs are kept in CloudWatch Logs."
  type        = number
  default     = 365

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a retention CloudWatch Logs supports (e.g. 30, 90, 365)."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
