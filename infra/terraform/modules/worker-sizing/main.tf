# Worker pod sizes per GPU type that fit the nodes: pure (no provider), so tests evaluate it
# with `terraform plan` and the platform stack fails its plan when a worker would not fit.
#
# A node's allocatable resources, as Karpenter and the kubelet compute them for EKS AMIs:
#   CPU:    vCPUs - kube-reserved (6% of the first core, 1% of the second, 0.5% of the third
#           and fourth, 0.25% of every further one)
#   memory: the instance's memory less 7.5% (Karpenter's VM overhead) - kube-reserved
#           (255 MiB + 11 MiB x maxPods) - the hard eviction threshold (100 MiB)
#   disk:   the data volume less the 10% nodefs eviction threshold and 1 GiB kube-reserved
# then less what the node's DaemonSets request and the room for images. One GPU's share is
# that divided by the node's GPUs, the smallest over the pool's instance types, so a pod of
# n GPUs (n x the share) fits every instance type that has n GPUs.

locals {
  catalog = jsondecode(file("${path.module}/instance-types.json"))

  known = { for t, p in var.pools : t => [for i in p.instance_types : i if contains(keys(local.catalog), i)] }

  allocatable = {
    for t, p in var.pools : t => {
      for i in local.known[t] : i => {
        gpus = local.catalog[i].gpus
        cpu_millis = (
          local.catalog[i].vcpu * 1000 - ceil(
            60 + (local.catalog[i].vcpu >= 2 ? 10 : 0) + min(max(local.catalog[i].vcpu - 2, 0), 2) * 5
            + max(local.catalog[i].vcpu - 4, 0) * 2.5
          ) - var.daemonset_requests.cpu_millis
        )
        memory_mib = (
          floor(local.catalog[i].memory_mib * 0.925) - (255 + 11 * var.max_pods) - 100
          -var.daemonset_requests.memory_mib
        )
        ephemeral_gib = floor(p.disk_gib * 0.9) - 1 - var.image_gib
      }
    }
  }

  # The largest share every instance type of the pool fits (CPU in 100m, memory in 256 MiB steps).
  fitted = {
    for t, nodes in local.allocatable : t => {
      cpu_millis    = min([for n in values(nodes) : floor(n.cpu_millis / n.gpus / 100) * 100]...)
      memory_mib    = min([for n in values(nodes) : floor(n.memory_mib / n.gpus / 256) * 256]...)
      ephemeral_gib = min([for n in values(nodes) : floor(n.ephemeral_gib / n.gpus)]...)
    } if length(nodes) > 0
  }

  shares = {
    for t, f in local.fitted : t => {
      cpu_millis    = coalesce(var.pools[t].share.cpu_millis, f.cpu_millis)
      memory_mib    = coalesce(var.pools[t].share.memory_mib, f.memory_mib)
      ephemeral_gib = coalesce(var.pools[t].share.ephemeral_gib, f.ephemeral_gib)
      model_cache_gib = coalesce(
        var.pools[t].share.model_cache_gib,
        floor(coalesce(var.pools[t].share.ephemeral_gib, f.ephemeral_gib) * var.model_cache_percent / 100),
      )
    }
  }

  # Every (pool, instance type): does a pod with all of the node's GPUs fit it?
  misfits = flatten([
    for t, share in local.shares : [
      for i, n in local.allocatable[t] : "${t}/${i}" if(
        n.gpus * share.cpu_millis > n.cpu_millis
        || n.gpus * share.memory_mib > n.memory_mib
        || n.gpus * share.ephemeral_gib > n.ephemeral_gib
      )
    ]
  ])
  unknown    = flatten([for t, p in var.pools : [for i in p.instance_types : "${t}/${i}" if !contains(keys(local.catalog), i)]])
  mixed_gpus = [for t, nodes in local.allocatable : t if length(distinct([for i in keys(nodes) : local.catalog[i].gpu])) > 1]
  no_room    = [for t, s in local.shares : t if s.cpu_millis < 1000 || s.memory_mib < 4096 || s.model_cache_gib >= s.ephemeral_gib || s.model_cache_gib < 1]
}
