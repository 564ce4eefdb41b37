variable "name" {
  description = "Prefix of the secrets' names and of the other resources."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "app_database_username" {
  description = "PostgreSQL role of the services (created by the migration Job; not the master user)."
  type        = string
  default     = "tokenmill_app"

  validation {
    condition     = can(regex("^[a-z][a-z0-9_]{0,62}$", var.app_database_username)) && !contains(["postgres", "rdsadmin", "tokenmill"], var.app_database_username)
    error_message = "app_database_username must be a lower-case identifier other than the master user's."
  }
}

variable "versions" {
  description = "Version of each generated secret (internal-token, worker-token, secret-key, database-app); raise one to write a new value (rotation). Default 1."
  type        = map(number)
  default     = {}

  validation {
    condition     = alltrue([for k, v in var.versions : contains(["internal-token", "worker-token", "secret-key", "database-app"], k) && v >= 1 && floor(v) == v])
    error_message = "versions keys are internal-token, worker-token, secret-key and database-app; values whole numbers from 1."
  }
}

variable "oidc_provider_arn" {
  description = "ARN of the cluster's IAM OIDC provider (modules/cluster output)."
  type        = string
}

variable "oidc_issuer" {
  description = "OIDC issuer of the cluster without https:// (modules/cluster output)."
  type        = string
}

variable "namespace" {
  description = "Kubernetes namespace of Tokenmill (and of its SecretStore)."
  type        = string
  default     = "tokenmill"
}

variable "service_account" {
  description = "Service account the SecretStore authenticates as (modules/tokenmill creates it)."
  type        = string
  default     = "tokenmill-secrets"
}

variable "readable_secret_arns" {
  description = "Other secrets External Secrets reads for Tokenmill: RDS's master user secret, the Redis users' secrets."
  type        = list(string)
  default     = []
}

variable "readable_kms_key_arns" {
  description = "KMS keys of readable_secret_arns (decrypt through Secrets Manager only)."
  type        = list(string)
  default     = []
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
