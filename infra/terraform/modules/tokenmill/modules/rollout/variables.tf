variable "max_stream_seconds" {
  description = "TOKENMILL_MAX_STREAM_SECONDS: the longest a response stream may run (the gateway ends it then)."
  type        = number
  default     = 600

  validation {
    condition     = var.max_stream_seconds >= 30 && var.max_stream_seconds <= 3600 && floor(var.max_stream_seconds) == var.max_stream_seconds
    error_message = "max_stream_seconds must be a whole number of seconds from 30 to 3600 (an ALB keeps a draining target at most an hour)."
  }
}

variable "endpoint_propagation_seconds" {
  description = "How long the load balancer controller and kube-proxy may take to see a pod leave its endpoints."
  type        = number
  default     = 10
}

variable "margin_seconds" {
  description = "Kept between the end of the graceful shutdown and the kill (logs flushed, the process exits)."
  type        = number
  default     = 30
}
