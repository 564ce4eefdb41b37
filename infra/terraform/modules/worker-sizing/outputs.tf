output "worker_resources" {
  description = "One GPU's share of a worker pod per GPU type (TOKENMILL_WORKER_RESOURCES, as JSON)."
  value       = local.shares

  precondition {
    condition     = length(local.unknown) == 0
    error_message = "Instance types missing from modules/worker-sizing/instance-types.json (add their vCPUs, memory and GPUs): ${join(", ", local.unknown)}."
  }

  precondition {
    condition     = length(local.mixed_gpus) == 0
    error_message = "A pool mixes GPU models (one GPU type, one GPU model): ${join(", ", local.mixed_gpus)}."
  }

  precondition {
    condition     = length(local.misfits) == 0
    error_message = "Worker pods would not fit these node types (GPUs x the share exceeds what the node can allocate after its DaemonSets; lower the share or pick larger instances): ${join(", ", local.misfits)}."
  }

  precondition {
    condition     = length(local.no_room) == 0
    error_message = "These GPU types leave a worker less than 1 CPU or 4 GiB, or a model cache that is not inside its ephemeral storage: ${join(", ", local.no_room)}."
  }
}

output "allocatable" {
  description = "Per GPU type and instance type: GPUs, and what a worker can use after the kubelet's reservations, the DaemonSets and the images (cpu_millis, memory_mib, ephemeral_gib)."
  value       = local.allocatable
}

output "max_gpus_per_pod" {
  description = "Per GPU type, the most GPUs one worker pod can ask (the largest node of the pool)."
  value       = { for t, nodes in local.allocatable : t => max([for n in values(nodes) : n.gpus]...) if length(nodes) > 0 }
}

output "gpu_models" {
  description = "Per GPU type, the GPU model of its instance types (from instance-types.json)."
  value       = { for t, nodes in local.allocatable : t => distinct([for i in keys(nodes) : local.catalog[i].gpu]) }
}
