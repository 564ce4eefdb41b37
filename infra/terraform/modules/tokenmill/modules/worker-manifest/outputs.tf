output "name" {
  description = "Name of the worker Deployment."
  value       = local.name
}

output "manifest" {
  description = "The apps/v1 Deployment, as the autoscaler's worker_manifest() builds it."
  value       = local.manifest

  # What worker_manifest() refuses.
  precondition {
    condition     = !local.vllm || var.gpu_type != null
    error_message = "A vllm deployment needs a GPU type: vllm_image is vLLM's CUDA build."
  }
  precondition {
    condition     = !local.vllm || var.vllm_image != null
    error_message = "A vllm deployment needs vllm_image."
  }
  precondition {
    condition     = !local.vllm || min(local.units * local.share.cpu_millis - local.vllm_worker.cpu_millis, local.units * local.share.memory_mib - local.vllm_worker.memory_mib, local.units * local.share.ephemeral_gib - local.vllm_worker.ephemeral_gib) > 0
    error_message = "The GPU type's share leaves nothing for vLLM beside the worker."
  }
}

output "disruption_budget" {
  description = "The PodDisruptionBudget the autoscaler keeps beside the Deployment (worker_disruption_budget())."
  value       = local.disruption_budget
}
