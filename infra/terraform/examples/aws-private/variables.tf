variable "region" {
  description = "AWS region of everything."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "region must be an AWS region such as eu-west-1."
  }
}

variable "name" {
  description = "Name of the installation: the cluster, VPC and the prefix of every other resource."
  type        = string
  default     = "tokenmill"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,20}[a-z0-9]$", var.name))
    error_message = "name must be 3-22 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "azs" {
  description = "Availability zones of the region to spread over (named, so the set never changes under you), e.g. [\"eu-west-1a\", \"eu-west-1b\", \"eu-west-1c\"]."
  type        = list(string)

  validation {
    condition     = length(var.azs) >= 2 && length(var.azs) <= 6 && alltrue([for az in var.azs : startswith(az, var.region)])
    error_message = "Give 2 to 6 availability zones of the region."
  }
}

variable "vpc_cidr" {
  description = "CIDR block of the VPC (/16 to /20)."
  type        = string
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0))
    error_message = "vpc_cidr must be an IPv4 CIDR block."
  }
}

variable "single_nat_gateway" {
  description = "One NAT gateway instead of one per zone (cheaper, not zone-redundant)."
  type        = bool
  default     = false
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version."
  type        = string
  default     = "1.34"

  validation {
    condition     = can(regex("^1\\.[0-9]{2}$", var.kubernetes_version))
    error_message = "kubernetes_version must look like 1.34."
  }
}

variable "cluster_endpoint_public_access" {
  description = "Expose the Kubernetes API to cluster_public_access_cidrs (off: reach it from inside the VPC)."
  type        = bool
  default     = false
}

variable "cluster_public_access_cidrs" {
  description = "CIDR blocks allowed to the public Kubernetes API when it is on (your office, your CI)."
  type        = list(string)
  default     = []

  validation {
    condition     = !contains(var.cluster_public_access_cidrs, "0.0.0.0/0")
    error_message = "Do not open the Kubernetes API to 0.0.0.0/0."
  }
}

variable "cluster_admin_principal_arns" {
  description = "IAM roles or users given cluster-admin access besides the identity that runs Terraform."
  type        = list(string)
  default     = []
}

variable "system_node_group" {
  description = "Sizes of the services' node group (see modules/cluster)."
  type = object({
    instance_types = optional(list(string), ["m7i.xlarge"])
    min_size       = optional(number, 2)
    max_size       = optional(number, 6)
    desired_size   = optional(number, 3)
    disk_size_gib  = optional(number, 50)
  })
  default = {}
}

variable "gpu_node_groups" {
  description = "GPU node groups by name; gpu_type is the price book's name of the GPU (see modules/cluster)."
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
  default = {
    a10g = { gpu_type = "a10g", instance_types = ["g5.2xlarge"] }
  }

  validation {
    condition     = length(var.gpu_node_groups) <= 10
    error_message = "At most 10 GPU node groups."
  }
}

variable "db_instance_class" {
  description = "RDS instance class of PostgreSQL."
  type        = string
  default     = "db.r7g.large"
}

variable "db_multi_az" {
  description = "Keep a PostgreSQL standby in a second zone."
  type        = bool
  default     = true
}

variable "db_backup_retention_days" {
  description = "Days of PostgreSQL point-in-time backups."
  type        = number
  default     = 14

  validation {
    condition     = var.db_backup_retention_days >= 7 && var.db_backup_retention_days <= 35
    error_message = "db_backup_retention_days must be between 7 and 35."
  }
}

variable "db_deletion_protection" {
  description = "Refuse to delete the database (turn off before a destroy)."
  type        = bool
  default     = true
}

variable "redis_node_type" {
  description = "ElastiCache node type of Redis."
  type        = string
  default     = "cache.r7g.large"
}

variable "redis_nodes" {
  description = "Redis nodes (primary plus replicas); 2 or more fail over automatically."
  type        = number
  default     = 2

  validation {
    condition     = var.redis_nodes >= 1 && var.redis_nodes <= 6
    error_message = "redis_nodes must be between 1 and 6."
  }
}

variable "bucket_name" {
  description = "Name of the weights and adapters bucket; null: <name>-<account id>-<region>."
  type        = string
  default     = null

  validation {
    condition     = var.bucket_name == null || can(regex("^[a-z0-9][a-z0-9.-]{1,56}[a-z0-9]$", coalesce(var.bucket_name, "x")))
    error_message = "bucket_name must be 3-58 lower-case letters, digits, '.' or '-'."
  }
}

variable "namespace" {
  description = "Kubernetes namespace of Tokenmill."
  type        = string
  default     = "tokenmill"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.namespace))
    error_message = "namespace must be a DNS label."
  }
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

variable "stripe_api_key" {
  description = "Stripe secret key; null: no Stripe."
  type        = string
  default     = null
  sensitive   = true
}

variable "stripe_webhook_secret" {
  description = "Stripe webhook signing secret; null: the webhook answers 503."
  type        = string
  default     = null
  sensitive   = true
}

variable "tokenmill_settings" {
  description = "Further TOKENMILL_* settings of the services (see the README's settings table)."
  type        = map(string)
  default     = {}
}

variable "tags" {
  description = "Tags added to every AWS resource."
  type        = map(string)
  default     = {}
}
