output "max_stream_seconds" {
  description = "TOKENMILL_MAX_STREAM_SECONDS."
  value       = var.max_stream_seconds
}

output "deregistration_delay_seconds" {
  description = "The ALB target groups' deregistration delay (deregistration_delay.timeout_seconds)."
  value       = local.deregistration_delay
}

output "prestop_seconds" {
  description = "How long preStop sleeps before the server gets SIGTERM."
  value       = local.prestop

  precondition {
    condition     = local.prestop >= local.deregistration_delay
    error_message = "preStop must outlast the ALB's deregistration delay."
  }
}

output "graceful_shutdown_seconds" {
  description = "TOKENMILL_SHUTDOWN_GRACE_SECONDS: uvicorn's graceful timeout after SIGTERM."
  value       = local.graceful

  precondition {
    condition     = local.graceful >= var.max_stream_seconds
    error_message = "The graceful timeout must be at least the longest stream."
  }
}

output "termination_grace_period_seconds" {
  description = "terminationGracePeriodSeconds of the pods behind the ALB."
  value       = local.grace_period

  precondition {
    condition     = local.grace_period > local.prestop + local.graceful
    error_message = "The grace period must outlast preStop and the graceful shutdown together."
  }
}

output "worker_termination_grace_period_seconds" {
  description = "terminationGracePeriodSeconds of the workers (the autoscaler's worker_manifest)."
  value       = local.worker_grace_period
}
