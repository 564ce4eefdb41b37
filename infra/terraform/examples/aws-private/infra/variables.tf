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

variable "api_access_cidrs" {
  description = "CIDR blocks inside the network allowed to the private Kubernetes API on 443: the subnet of the runner that applies the platform stack (CI in the VPC, a VPN, a peered network), operators' VPN."
  type        = list(string)
  default     = []
}

variable "api_access_security_group_ids" {
  description = "Security groups (a CI runner's, a bastion's) allowed to the private Kubernetes API on 443."
  type        = list(string)
  default     = []
}

check "the_runner_reaches_the_api" {
  assert {
    condition     = var.cluster_endpoint_public_access || length(var.api_access_cidrs) + length(var.api_access_security_group_ids) > 0
    error_message = "Nothing will reach the Kubernetes API (private, and no api_access_cidrs or api_access_security_group_ids): the platform stack cannot be applied from outside the cluster."
  }
}

variable "system_node_group" {
  description = "The services' node group: AMI release (pinned: required), instance types and sizes (see modules/cluster)."
  type = object({
    release_version = string
    instance_types  = optional(list(string), ["m7i.xlarge"])
    min_size        = optional(number, 2)
    max_size        = optional(number, 6)
    desired_size    = optional(number, 3)
    disk_size_gib   = optional(number, 50)
  })
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

variable "secret_versions" {
  description = "Raise one (internal-token, worker-token, secret-key, database-app) to write a new value into Secrets Manager (rotation; see the README)."
  type        = map(number)
  default     = {}
}

variable "route53_zone_ids" {
  description = "Route 53 hosted zones of the API and admin host names; external-dns (installed by the platform stack) keeps their records. Empty: point the names at the load balancers yourself."
  type        = list(string)
  default     = []
}

variable "log_retention_days" {
  description = "Days the containers' logs are kept in CloudWatch Logs."
  type        = number
  default     = 90
}

variable "tags" {
  description = "Tags added to every AWS resource."
  type        = map(string)
  default     = {}
}
