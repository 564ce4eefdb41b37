variable "namespace" {
  description = "Namespace of Tokenmill (its pods are scraped there)."
  type        = string
}

variable "services" {
  description = "app.kubernetes.io/name of each service Deployment with /metrics on its http port (gateway, control plane, autoscaler)."
  type        = list(string)
}

variable "metrics_secret" {
  description = "Secret (key token) holding the workers' token, which every /metrics (services and workers) asks for."
  type        = string
}

variable "max_pending_worker_minutes" {
  description = "How long worker pods may wait for a GPU node before an alert (quota, Karpenter limits, capacity)."
  type        = number
  default     = 15
}
