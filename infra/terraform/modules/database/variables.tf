variable "name" {
  description = "Identifier of the RDS instance (and prefix of its other resources)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,50}[a-z0-9]$", var.name))
    error_message = "name must be 3-52 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "vpc_id" {
  description = "VPC of the database's security group."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets of the database (at least two availability zones)."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "RDS needs subnets in at least two availability zones."
  }
}

variable "allowed_security_group_ids" {
  description = "Security groups allowed to connect on the PostgreSQL port (the cluster's nodes)."
  type        = list(string)
}

variable "engine_version" {
  description = "PostgreSQL version: a major version (minor upgrades are applied automatically) or major.minor."
  type        = string
  default     = "16"

  validation {
    condition     = can(regex("^(1[4-9])(\\.[0-9]+)?$", var.engine_version))
    error_message = "engine_version must be PostgreSQL 14 or newer, e.g. 16 or 16.4."
  }
}

variable "instance_class" {
  description = "RDS instance class."
  type        = string
  default     = "db.r7g.large"

  validation {
    condition     = startswith(var.instance_class, "db.")
    error_message = "instance_class must be an RDS class such as db.r7g.large."
  }
}

variable "allocated_storage_gib" {
  description = "Initial storage in GiB."
  type        = number
  default     = 100

  validation {
    condition     = var.allocated_storage_gib >= 20
    error_message = "allocated_storage_gib must be at least 20."
  }
}

variable "max_allocated_storage_gib" {
  description = "Ceiling of storage autoscaling in GiB."
  type        = number
  default     = 1000
}

variable "multi_az" {
  description = "Keep a synchronous standby in a second availability zone (automatic failover)."
  type        = bool
  default     = true
}

variable "backup_retention_days" {
  description = "Days automated backups (point-in-time recovery) are kept."
  type        = number
  default     = 14

  validation {
    condition     = var.backup_retention_days >= 7 && var.backup_retention_days <= 35
    error_message = "backup_retention_days must be between 7 and 35."
  }
}

variable "backup_window" {
  description = "Daily UTC window of automated backups (hh24:mi-hh24:mi)."
  type        = string
  default     = "02:00-03:00"
}

variable "maintenance_window" {
  description = "Weekly UTC maintenance window (ddd:hh24:mi-ddd:hh24:mi), outside the backup window."
  type        = string
  default     = "sun:04:00-sun:05:00"
}

variable "deletion_protection" {
  description = "Refuse to delete the instance (turn off explicitly before a destroy)."
  type        = bool
  default     = true
}

variable "database_name" {
  description = "Name of the database Tokenmill uses."
  type        = string
  default     = "tokenmill"

  validation {
    condition     = can(regex("^[a-z][a-z0-9_]{0,62}$", var.database_name))
    error_message = "database_name must be a lower-case PostgreSQL identifier."
  }
}

variable "username" {
  description = "Master user name (the owner the migrations run as; the services connect as their own role, which the migration Job creates)."
  type        = string
  default     = "tokenmill"

  validation {
    condition     = can(regex("^[a-z][a-z0-9_]{0,62}$", var.username)) && !contains(["postgres", "admin", "rdsadmin"], var.username)
    error_message = "username must be a lower-case identifier, and not a reserved name."
  }
}

variable "log_retention_days" {
  description = "Days the PostgreSQL logs are kept in CloudWatch Logs."
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
