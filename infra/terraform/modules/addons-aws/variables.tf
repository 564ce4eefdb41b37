variable "cluster_name" {
  description = "Name of the EKS cluster (modules/cluster output); prefix of every resource here."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.cluster_name))
    error_message = "cluster_name must be 3-32 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "route53_zone_ids" {
  description = "Route 53 hosted zones external-dns may write the API and admin host names into; empty: no external-dns role (point the names at the load balancers yourself)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for id in var.route53_zone_ids : can(regex("^Z[0-9A-Z]{4,31}$", id))])
    error_message = "route53_zone_ids must be hosted zone ids (Z...)."
  }
}

variable "log_retention_days" {
  description = "Days the containers' logs (Fluent Bit) are kept in CloudWatch Logs."
  type        = number
  default     = 90

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
