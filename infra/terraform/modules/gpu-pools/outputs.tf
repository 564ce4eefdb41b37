output "manifests" {
  description = "The EC2NodeClasses and NodePools (Karpenter v1), one of each per GPU type."
  value       = concat(local.node_classes, local.node_pools)
}

output "gpu_types" {
  description = "GPU types the pools offer (values of the tokenmill.dev/gpu-type label)."
  value       = sort(keys(var.pools))
}

output "needs_device_plugin" {
  description = "Whether the NVIDIA device plugin must be installed (Bottlerocket's NVIDIA variants have it built in)."
  value       = var.ami_family != "bottlerocket"
}
