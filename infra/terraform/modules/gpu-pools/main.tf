# Karpenter's GPU node pools: an EC2NodeClass and a NodePool per GPU type, as plain objects
# (pure: no provider; modules/addons applies them, tests evaluate them). The nodes carry the
# label and taint the worker pods select and tolerate (autoscaler/kubernetes.py):
#   label tokenmill.dev/gpu-type=<gpu type>, taint nvidia.com/gpu=present:NoSchedule.

locals {
  alias = "${var.ami_family}@${var.ami_version}"

  # Bottlerocket boots from a small OS volume and keeps images and pod data on a second one.
  volumes = {
    for t, p in var.pools : t => (
      var.ami_family == "bottlerocket"
      ? [
        { deviceName = "/dev/xvda", ebs = { volumeSize = "8Gi", volumeType = "gp3", encrypted = true, deleteOnTermination = true } },
        { deviceName = "/dev/xvdb", ebs = { volumeSize = "${p.disk_gib}Gi", volumeType = "gp3", encrypted = true, deleteOnTermination = true } },
      ]
      : [
        { deviceName = "/dev/xvda", ebs = { volumeSize = "${p.disk_gib}Gi", volumeType = "gp3", encrypted = true, deleteOnTermination = true } },
      ]
    )
  }

  node_classes = [
    for t, p in var.pools : {
      apiVersion = "karpenter.k8s.aws/v1"
      kind       = "EC2NodeClass"
      metadata   = { name = "gpu-${t}" }
      spec = {
        role                       = var.node_role_name
        amiSelectorTerms           = [{ alias = local.alias }]
        subnetSelectorTerms        = [{ tags = { "karpenter.sh/discovery" = var.cluster_name } }]
        securityGroupSelectorTerms = [{ tags = { "karpenter.sh/discovery" = var.cluster_name } }]
        # IMDSv2 only, one hop: pods cannot reach the node's role (workers use IRSA).
        metadataOptions     = { httpEndpoint = "enabled", httpProtocolIPv6 = "disabled", httpTokens = "required", httpPutResponseHopLimit = 1 }
        blockDeviceMappings = local.volumes[t]
        kubelet             = { maxPods = var.max_pods }
        tags                = merge(var.tags, { Name = "${var.cluster_name}-gpu-${t}", "tokenmill.dev/gpu-type" = t })
      }
    }
  ]

  node_pools = [
    for t, p in var.pools : {
      apiVersion = "karpenter.sh/v1"
      kind       = "NodePool"
      metadata   = { name = "gpu-${t}" }
      spec = {
        template = {
          metadata = { labels = { "tokenmill.dev/pool" = "gpu", "tokenmill.dev/gpu-type" = t } }
          spec = {
            nodeClassRef = { group = "karpenter.k8s.aws", kind = "EC2NodeClass", name = "gpu-${t}" }
            taints       = [{ key = "nvidia.com/gpu", value = "present", effect = "NoSchedule" }]
            requirements = [
              { key = "node.kubernetes.io/instance-type", operator = "In", values = p.instance_types },
              { key = "karpenter.sh/capacity-type", operator = "In", values = p.capacity_types },
              { key = "kubernetes.io/arch", operator = "In", values = ["amd64"] },
              { key = "kubernetes.io/os", operator = "In", values = ["linux"] },
            ]
            # Nodes are replaced within a month (a new AMI when ami_version changes sooner).
            expireAfter = "720h"
          }
        }
        limits = { "nvidia.com/gpu" = tostring(p.max_gpus) }
        # Only empty nodes go: a running worker is never moved to save money (drift and expiry
        # still replace nodes, one worker of a deployment at a time: its PodDisruptionBudget).
        disruption = { consolidationPolicy = "WhenEmpty", consolidateAfter = "5m" }
      }
    }
  ]
}
