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

variable "api_access_cidrs" {
  description = "CIDR blocks inside the network (a CI runner's subnet, a VPN) allowed to the private Kubernetes API on 443: whoever applies the platform stack needs one of these or api_access_security_group_ids."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for cidr in var.api_access_cidrs : can(cidrhost(cidr, 0)) && cidr != "0.0.0.0/0"])
    error_message = "api_access_cidrs must be CIDR blocks, and not 0.0.0.0/0."
  }
}

variable "api_access_security_group_ids" {
  description = "Security groups (a runner's, a bastion's) allowed to the private Kubernetes API on 443."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for id in var.api_access_security_group_ids : can(regex("^sg-[0-9a-f]{8,17}$", id))])
    error_message = "api_access_security_group_ids must be security group ids (sg-...)."
  }
}

variable "system_node_group" {
  description = <<-EOT
    The managed node group of the services (gateway, control plane, Celery, autoscaler) and the
    cluster add-ons (Karpenter included). release_version pins the EKS AL2023 AMI release (find
    the current one: aws ssm get-parameter --name
    /aws/service/eks/optimized-ami/<kubernetes_version>/amazon-linux-2023/x86_64/standard/recommended/release_version);
    nodes are replaced, one at a time, only when it changes.
  EOT
  type = object({
    release_version = string
    instance_types  = optional(list(string), ["m7i.xlarge"])
    min_size        = optional(number, 2)
    max_size        = optional(number, 6)
    desired_size    = optional(number, 3)
    disk_size_gib   = optional(number, 50)
  })

  validation {
    condition     = var.system_node_group.min_size >= 1 && var.system_node_group.min_size <= var.system_node_group.desired_size && var.system_node_group.desired_size <= var.system_node_group.max_size
    error_message = "The system node group needs 1 <= min_size <= desired_size <= max_size."
  }

  validation {
    condition     = can(regex("^1\\.[0-9]{2}\\.[0-9]+-[0-9]{8}$", var.system_node_group.release_version))
    error_message = "release_version must be an EKS AMI release such as 1.34.2-20251120."
  }
}

variable "addons" {
  description = "EKS add-ons besides vpc-cni (always installed), by name, with an optional version (null: the default for the cluster version). metrics-server feeds the gateway's autoscaler; eks-pod-identity-agent serves the add-ons' Pod Identity roles."
  type = map(object({
    version = optional(string)
  }))
  default = {
    coredns                = {}
    kube-proxy             = {}
    metrics-server         = {}
    eks-pod-identity-agent = {}
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
