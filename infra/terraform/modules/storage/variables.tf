variable "bucket_name" {
  description = "Name of the bucket of model weights, adapters and billing exports (globally unique); the access-log bucket is named <bucket_name>-logs."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,56}[a-z0-9]$", var.bucket_name)) && !can(regex("\\.\\.", var.bucket_name))
    error_message = "bucket_name must be 3-58 lower-case letters, digits, '.' or '-' (room for the -logs suffix)."
  }
}

variable "prefix" {
  description = "Key prefix Tokenmill stores under (TOKENMILL_STORAGE_URL = s3://<bucket>/<prefix>)."
  type        = string
  default     = "tokenmill"

  validation {
    condition     = can(regex("^[a-zA-Z0-9][a-zA-Z0-9._/-]*[a-zA-Z0-9]$", var.prefix)) && !endswith(var.prefix, "/")
    error_message = "prefix must be a key prefix without leading or trailing '/'."
  }
}

variable "noncurrent_version_days" {
  description = "Days an overwritten or deleted object's previous version is kept (recovery from mistakes)."
  type        = number
  default     = 30

  validation {
    condition     = var.noncurrent_version_days >= 1
    error_message = "noncurrent_version_days must be at least 1."
  }
}

variable "access_log_days" {
  description = "Days the bucket's access logs are kept."
  type        = number
  default     = 365

  validation {
    condition     = var.access_log_days >= 90
    error_message = "Keep access logs for at least 90 days."
  }
}

variable "force_destroy" {
  description = "Allow destroying the buckets while they hold objects (test environments only)."
  type        = bool
  default     = false
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
  description = "Kubernetes namespace of the service accounts given access."
  type        = string
  default     = "tokenmill"
}

variable "writer_service_accounts" {
  description = "Service accounts that read and write objects anywhere under the prefix (control plane: adapter uploads; Celery: billing exports, batches' output files)."
  type        = list(string)
  default     = ["tokenmill-control-plane", "tokenmill-billing"]
}

variable "files_writer_service_accounts" {
  description = "Service accounts that read objects and write only under <prefix>/files/ (gateways: tokenizers of stored models; the uploads and deletions of /v1/files)."
  type        = list(string)
  default     = ["tokenmill-gateway"]
}

variable "reader_service_accounts" {
  description = "Service accounts that only read objects (workers: weights and adapters)."
  type        = list(string)
  default     = ["tokenmill-worker"]
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
