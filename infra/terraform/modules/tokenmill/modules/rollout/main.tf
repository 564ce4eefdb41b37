# The timings of a graceful rollout of the pods behind the ALB (pure: no provider, so tests
# evaluate them), in the order a pod goes:
#
#   1. The pod is marked for deletion: it leaves the endpoints, the ALB starts draining its
#      target (no new requests; those in flight continue for the deregistration delay, which
#      is the longest stream, so the ALB never cuts one).
#   2. preStop sleeps at least the deregistration delay (plus the time the controller takes to
#      see the change): the server keeps serving what the ALB still sends.
#   3. SIGTERM: uvicorn stops accepting and waits for requests in flight up to its graceful
#      timeout (TOKENMILL_SHUTDOWN_GRACE_SECONDS, at least TOKENMILL_MAX_STREAM_SECONDS).
#   4. The kubelet kills what is left after the grace period, which outlasts 2 and 3 together.
#
# New pods take traffic only once the ALB reports them healthy (the readiness gate the AWS Load
# Balancer Controller injects), so a rollout never runs short of ready targets.

locals {
  deregistration_delay = var.max_stream_seconds
  prestop              = local.deregistration_delay + var.endpoint_propagation_seconds
  graceful             = var.max_stream_seconds
  grace_period         = local.prestop + local.graceful + var.margin_seconds
  # Workers are not behind the ALB (the gateways route to them): no preStop; the grace period is
  # autoscaler/kubernetes.py's, MAX_STREAM_SECONDS + DRAIN_MARGIN_SECONDS.
  worker_grace_period = var.max_stream_seconds + 60
}
