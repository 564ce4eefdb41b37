# The AWS side of the cluster's add-ons, each with an IAM role of its own through EKS Pod
# Identity (no node-wide permissions): Karpenter (its controller, the role and access entry of
# the GPU nodes it launches, the interruption queue and the EventBridge rules feeding it), the
# AWS Load Balancer Controller, external-dns (the named hosted zones only) and Fluent Bit (one
# encrypted log group). modules/addons installs the add-ons themselves into the cluster.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  partition   = data.aws_partition.current.partition
  account     = data.aws_caller_identity.current.account_id
  region      = data.aws_region.current.name
  account_arn = "arn:${local.partition}:iam::${local.account}:root"
  cluster_arn = "arn:${local.partition}:eks:${local.region}:${local.account}:cluster/${var.cluster_name}"
  ec2         = "arn:${local.partition}:ec2:${local.region}"
  log_group   = "/aws/eks/${var.cluster_name}/containers"
  prefix      = substr(var.cluster_name, 0, 20)

  # namespace/service account of each add-on (modules/addons installs them so).
  service_accounts = merge(
    {
      karpenter                    = { namespace = "kube-system", name = "karpenter" }
      aws-load-balancer-controller = { namespace = "kube-system", name = "aws-load-balancer-controller" }
      fluent-bit                   = { namespace = "logging", name = "fluent-bit" }
    },
    length(var.route53_zone_ids) == 0 ? {} : { external-dns = { namespace = "kube-system", name = "external-dns" } },
  )
  policies = merge(
    {
      karpenter                    = data.aws_iam_policy_document.karpenter.json
      aws-load-balancer-controller = data.aws_iam_policy_document.load_balancer_controller.json
      fluent-bit                   = data.aws_iam_policy_document.fluent_bit.json
    },
    length(var.route53_zone_ids) == 0 ? {} : { external-dns = data.aws_iam_policy_document.external_dns.json },
  )
}

# --- one role per add-on, assumed through EKS Pod Identity ------------------------------------

data "aws_iam_policy_document" "pod_identity_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]

    principals {
      type        = "Service"
      identifiers = ["pods.eks.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [local.account]
    }
  }
}

resource "aws_iam_role" "addon" {
  for_each = local.service_accounts

  name_prefix        = "${local.prefix}-${substr(each.key, 0, 12)}-"
  description        = "${var.cluster_name}: ${each.key} (${each.value.namespace}/${each.value.name}, EKS Pod Identity)"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_assume.json

  tags = var.tags
}

resource "aws_iam_role_policy" "addon" {
  for_each = local.service_accounts

  name   = each.key
  role   = aws_iam_role.addon[each.key].id
  policy = local.policies[each.key]
}

resource "aws_eks_pod_identity_association" "addon" {
  for_each = local.service_accounts

  cluster_name    = var.cluster_name
  namespace       = each.value.namespace
  service_account = each.value.name
  role_arn        = aws_iam_role.addon[each.key].arn

  tags = var.tags
}

# --- Karpenter: the GPU nodes' role, the interruption queue, the controller's permissions -----

data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

# The role of the nodes Karpenter launches (EC2NodeClass spec.role): join the cluster, pull
# images. Pods never get it (IMDSv2 with one hop; workers use IRSA).
resource "aws_iam_role" "karpenter_node" {
  name_prefix        = "${local.prefix}-gpu-node-"
  description        = "${var.cluster_name}: nodes launched by Karpenter"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json

  tags = var.tags
}

resource "aws_iam_role_policy_attachment" "karpenter_node" {
  for_each = toset(["AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryReadOnly"])

  role       = aws_iam_role.karpenter_node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/${each.value}"
}

resource "aws_eks_access_entry" "karpenter_node" {
  cluster_name  = var.cluster_name
  principal_arn = aws_iam_role.karpenter_node.arn
  type          = "EC2_LINUX"

  tags = var.tags
}

# Spot interruptions, rebalance recommendations, scheduled maintenance and instance state
# changes reach Karpenter here, so it drains a node before EC2 takes it away.
resource "aws_sqs_queue" "interruption" {
  name                      = "${var.cluster_name}-karpenter"
  message_retention_seconds = 300
  sqs_managed_sse_enabled   = true

  tags = var.tags
}

data "aws_iam_policy_document" "interruption_queue" {
  statement {
    sid       = "EventBridgeAndSQS"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.interruption.arn]

    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com", "sqs.amazonaws.com"]
    }
  }

  statement {
    sid       = "DenyHTTP"
    effect    = "Deny"
    actions   = ["sqs:*"]
    resources = [aws_sqs_queue.interruption.arn]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_sqs_queue_policy" "interruption" {
  queue_url = aws_sqs_queue.interruption.url
  policy    = data.aws_iam_policy_document.interruption_queue.json
}

resource "aws_cloudwatch_event_rule" "interruption" {
  for_each = {
    scheduled-change = { source = ["aws.health"], detail-type = ["AWS Health Event"] }
    spot-interruption = {
      source      = ["aws.ec2"]
      detail-type = ["EC2 Spot Instance Interruption Warning"]
    }
    rebalance    = { source = ["aws.ec2"], detail-type = ["EC2 Instance Rebalance Recommendation"] }
    state-change = { source = ["aws.ec2"], detail-type = ["EC2 Instance State-change Notification"] }
  }

  name_prefix   = "${local.prefix}-${each.key}-"
  description   = "${var.cluster_name}: ${each.key} events for Karpenter"
  event_pattern = jsonencode(each.value)

  tags = var.tags
}

resource "aws_cloudwatch_event_target" "interruption" {
  for_each = aws_cloudwatch_event_rule.interruption

  rule = each.value.name
  arn  = aws_sqs_queue.interruption.arn
}

data "aws_iam_policy_document" "karpenter" {
  #checkov:skip=CKV_AWS_111:Karpenter's own policy: launches and tags are scoped by the cluster's ownership tags in the conditions, as its reference policy does.
  #checkov:skip=CKV_AWS_356:Describe*, pricing and instance-profile reads take no resource ARNs (Resource "*" is what IAM allows); writes are tag-conditioned.
  #checkov:skip=CKV_AWS_290:RunInstances/CreateFleet need the AMI, subnet and security group ARNs of any id Karpenter selects; the nodepool/cluster tag conditions bound them.
  #checkov:skip=CKV_AWS_355:Region-scoped read-only Describe* calls cannot name resources.
  statement {
    sid     = "ScopedEC2InstanceAccessActions"
    actions = ["ec2:RunInstances", "ec2:CreateFleet"]
    resources = [
      "arn:${local.partition}:ec2:${local.region}::image/*",
      "arn:${local.partition}:ec2:${local.region}::snapshot/*",
      "${local.ec2}:*:security-group/*",
      "${local.ec2}:*:subnet/*",
      "${local.ec2}:*:capacity-reservation/*",
    ]
  }

  statement {
    sid       = "ScopedEC2LaunchTemplateAccessActions"
    actions   = ["ec2:RunInstances", "ec2:CreateFleet"]
    resources = ["${local.ec2}:*:launch-template/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/kubernetes.io/cluster/${var.cluster_name}"
      values   = ["owned"]
    }

    condition {
      test     = "StringLike"
      variable = "aws:ResourceTag/karpenter.sh/nodepool"
      values   = ["*"]
    }
  }

  statement {
    sid     = "ScopedEC2InstanceActionsWithTags"
    actions = ["ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate"]
    resources = [
      "${local.ec2}:*:fleet/*",
      "${local.ec2}:*:instance/*",
      "${local.ec2}:*:volume/*",
      "${local.ec2}:*:network-interface/*",
      "${local.ec2}:*:launch-template/*",
      "${local.ec2}:*:spot-instances-request/*",
    ]

    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/kubernetes.io/cluster/${var.cluster_name}"
      values   = ["owned"]
    }

    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/eks:eks-cluster-name"
      values   = [var.cluster_name]
    }

    condition {
      test     = "StringLike"
      variable = "aws:RequestTag/karpenter.sh/nodepool"
      values   = ["*"]
    }
  }

  statement {
    sid     = "ScopedResourceCreationTagging"
    actions = ["ec2:CreateTags"]
    resources = [
      "${local.ec2}:*:fleet/*",
      "${local.ec2}:*:instance/*",
      "${local.ec2}:*:volume/*",
      "${local.ec2}:*:network-interface/*",
      "${local.ec2}:*:launch-template/*",
      "${local.ec2}:*:spot-instances-request/*",
    ]

    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/kubernetes.io/cluster/${var.cluster_name}"
      values   = ["owned"]
    }

    condition {
      test     = "StringEquals"
      variable = "ec2:CreateAction"
      values   = ["RunInstances", "CreateFleet", "CreateLaunchTemplate"]
    }
  }

  statement {
    sid       = "ScopedResourceTagging"
    actions   = ["ec2:CreateTags"]
    resources = ["${local.ec2}:*:instance/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/kubernetes.io/cluster/${var.cluster_name}"
      values   = ["owned"]
    }

    condition {
      test     = "StringLike"
      variable = "aws:ResourceTag/karpenter.sh/nodepool"
      values   = ["*"]
    }

    condition {
      test     = "ForAllValues:StringEquals"
      variable = "aws:TagKeys"
      values   = ["eks:eks-cluster-name", "karpenter.sh/nodeclaim", "Name"]
    }
  }

  statement {
    sid       = "ScopedDeletion"
    actions   = ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"]
    resources = ["${local.ec2}:*:instance/*", "${local.ec2}:*:launch-template/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/kubernetes.io/cluster/${var.cluster_name}"
      values   = ["owned"]
    }

    condition {
      test     = "StringLike"
      variable = "aws:ResourceTag/karpenter.sh/nodepool"
      values   = ["*"]
    }
  }

  statement {
    sid = "RegionalReadActions"
    actions = [
      "ec2:DescribeAvailabilityZones",
      "ec2:DescribeCapacityReservations",
      "ec2:DescribeImages",
      "ec2:DescribeInstances",
      "ec2:DescribeInstanceTypeOfferings",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeLaunchTemplates",
      "ec2:DescribeSecurityGroups",
      "ec2:DescribeSpotPriceHistory",
      "ec2:DescribeSubnets",
    ]
    resources = ["*"]

    condition {
      test     = "StringEquals"
      variable = "aws:RequestedRegion"
      values   = [local.region]
    }
  }

  statement {
    sid       = "SSMReadActions"
    actions   = ["ssm:GetParameter"]
    resources = ["arn:${local.partition}:ssm:${local.region}::parameter/aws/service/*"]
  }

  statement {
    sid       = "PricingReadActions"
    actions   = ["pricing:GetProducts"]
    resources = ["*"]
  }

  statement {
    sid       = "InterruptionQueueActions"
    actions   = ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"]
    resources = [aws_sqs_queue.interruption.arn]
  }

  statement {
    sid       = "PassNodeIAMRole"
    actions   = ["iam:PassRole"]
    resources = [aws_iam_role.karpenter_node.arn]

    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["ec2.amazonaws.com"]
    }
  }

  statement {
    sid       = "ScopedInstanceProfileCreationActions"
    actions   = ["iam:CreateInstanceProfile", "iam:TagInstanceProfile"]
    resources = ["arn:${local.partition}:iam::${local.account}:instance-profile/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/kubernetes.io/cluster/${var.cluster_name}"
      values   = ["owned"]
    }

    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/topology.kubernetes.io/region"
      values   = [local.region]
    }
  }

  statement {
    sid       = "ScopedInstanceProfileActions"
    actions   = ["iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile"]
    resources = ["arn:${local.partition}:iam::${local.account}:instance-profile/*"]

    condition {
      test     = "StringEquals"
      variable = "aws:ResourceTag/kubernetes.io/cluster/${var.cluster_name}"
      values   = ["owned"]
    }

    condition {
      test     = "StringLike"
      variable = "aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass"
      values   = ["*"]
    }
  }

  statement {
    sid       = "InstanceProfileReadActions"
    actions   = ["iam:GetInstanceProfile", "iam:ListInstanceProfiles"]
    resources = ["*"]
  }

  statement {
    sid       = "APIServerEndpointDiscovery"
    actions   = ["eks:DescribeCluster"]
    resources = [local.cluster_arn]
  }
}

# --- AWS Load Balancer Controller: ALBs for the Ingresses, in this cluster's name only ---------

data "aws_iam_policy_document" "load_balancer_controller" {
  #checkov:skip=CKV_AWS_111:The controller's reference policy: creation is conditioned on the elbv2.k8s.aws/cluster request tag, changes and deletions on the resource tag.
  #checkov:skip=CKV_AWS_356:Describe* and certificate listing take no resource ARNs; writes are tag-conditioned as in the controller's reference policy.
  #checkov:skip=CKV_AWS_290:Load balancers and target groups get generated ARNs; the elbv2.k8s.aws/cluster tag conditions bound the writes.
  #checkov:skip=CKV_AWS_355:Read-only Describe* and List* calls cannot name resources.
  statement {
    sid       = "ServiceLinkedRole"
    actions   = ["iam:CreateServiceLinkedRole"]
    resources = ["*"]

    condition {
      test     = "StringEquals"
      variable = "iam:AWSServiceName"
      values   = ["elasticloadbalancing.amazonaws.com"]
    }
  }

  statement {
    sid = "Describe"
    actions = [
      "ec2:DescribeAccountAttributes",
      "ec2:DescribeAddresses",
      "ec2:DescribeAvailabilityZones",
      "ec2:DescribeInternetGateways",
      "ec2:DescribeVpcs",
      "ec2:DescribeVpcPeeringConnections",
      "ec2:DescribeSubnets",
      "ec2:DescribeSecurityGroups",
      "ec2:DescribeInstances",
      "ec2:DescribeNetworkInterfaces",
      "ec2:DescribeTags",
      "ec2:GetCoipPoolUsage",
      "ec2:DescribeCoipPools",
      "ec2:GetSecurityGroupsForVpc",
      "ec2:DescribeIpamPools",
      "ec2:DescribeRouteTables",
      "elasticloadbalancing:Describe*",
      "acm:ListCertificates",
      "acm:DescribeCertificate",
      "iam:ListServerCertificates",
      "iam:GetServerCertificate",
      "wafv2:GetWebACL",
      "wafv2:GetWebACLForResource",
      "wafv2:AssociateWebACL",
      "wafv2:DisassociateWebACL",
      "shield:GetSubscriptionState",
      "shield:DescribeProtection",
      "shield:CreateProtection",
      "shield:DeleteProtection",
    ]
    resources = ["*"]
  }

  statement {
    sid       = "SecurityGroupIngress"
    actions   = ["ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress"]
    resources = ["*"]
  }

  statement {
    sid       = "CreateSecurityGroup"
    actions   = ["ec2:CreateSecurityGroup"]
    resources = ["*"]
  }

  statement {
    sid       = "TagNewSecurityGroups"
    actions   = ["ec2:CreateTags"]
    resources = ["arn:${local.partition}:ec2:*:*:security-group/*"]

    condition {
      test     = "StringEquals"
      variable = "ec2:CreateAction"
      values   = ["CreateSecurityGroup"]
    }

    condition {
      test     = "Null"
      variable = "aws:RequestTag/elbv2.k8s.aws/cluster"
      values   = ["false"]
    }
  }

  statement {
    sid       = "ManageOwnSecurityGroups"
    actions   = ["ec2:CreateTags", "ec2:DeleteTags", "ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress", "ec2:DeleteSecurityGroup"]
    resources = ["arn:${local.partition}:ec2:*:*:security-group/*"]

    condition {
      test     = "Null"
      variable = "aws:ResourceTag/elbv2.k8s.aws/cluster"
      values   = ["false"]
    }
  }

  statement {
    sid       = "CreateLoadBalancers"
    actions   = ["elasticloadbalancing:CreateLoadBalancer", "elasticloadbalancing:CreateTargetGroup"]
    resources = ["*"]

    condition {
      test     = "Null"
      variable = "aws:RequestTag/elbv2.k8s.aws/cluster"
      values   = ["false"]
    }
  }

  statement {
    sid = "Listeners"
    actions = [
      "elasticloadbalancing:CreateListener",
      "elasticloadbalancing:DeleteListener",
      "elasticloadbalancing:CreateRule",
      "elasticloadbalancing:DeleteRule",
    ]
    resources = ["*"]
  }

  statement {
    sid     = "TagOwnLoadBalancers"
    actions = ["elasticloadbalancing:AddTags", "elasticloadbalancing:RemoveTags"]
    resources = [
      "arn:${local.partition}:elasticloadbalancing:*:*:targetgroup/*/*",
      "arn:${local.partition}:elasticloadbalancing:*:*:loadbalancer/net/*/*",
      "arn:${local.partition}:elasticloadbalancing:*:*:loadbalancer/app/*/*",
      "arn:${local.partition}:elasticloadbalancing:*:*:listener/net/*/*/*",
      "arn:${local.partition}:elasticloadbalancing:*:*:listener/app/*/*/*",
      "arn:${local.partition}:elasticloadbalancing:*:*:listener-rule/net/*/*/*",
      "arn:${local.partition}:elasticloadbalancing:*:*:listener-rule/app/*/*/*",
    ]
  }

  statement {
    sid = "ManageOwnLoadBalancers"
    actions = [
      "elasticloadbalancing:ModifyLoadBalancerAttributes",
      "elasticloadbalancing:SetIpAddressType",
      "elasticloadbalancing:SetSecurityGroups",
      "elasticloadbalancing:SetSubnets",
      "elasticloadbalancing:DeleteLoadBalancer",
      "elasticloadbalancing:ModifyTargetGroup",
      "elasticloadbalancing:ModifyTargetGroupAttributes",
      "elasticloadbalancing:DeleteTargetGroup",
      "elasticloadbalancing:ModifyListenerAttributes",
      "elasticloadbalancing:ModifyCapacityReservation",
      "elasticloadbalancing:ModifyIpPools",
    ]
    resources = ["*"]

    condition {
      test     = "Null"
      variable = "aws:ResourceTag/elbv2.k8s.aws/cluster"
      values   = ["false"]
    }
  }

  statement {
    sid     = "TagOnCreate"
    actions = ["elasticloadbalancing:AddTags"]
    resources = [
      "arn:${local.partition}:elasticloadbalancing:*:*:targetgroup/*/*",
      "arn:${local.partition}:elasticloadbalancing:*:*:loadbalancer/net/*/*",
      "arn:${local.partition}:elasticloadbalancing:*:*:loadbalancer/app/*/*",
    ]

    condition {
      test     = "StringEquals"
      variable = "elasticloadbalancing:CreateAction"
      values   = ["CreateTargetGroup", "CreateLoadBalancer"]
    }

    condition {
      test     = "Null"
      variable = "aws:RequestTag/elbv2.k8s.aws/cluster"
      values   = ["false"]
    }
  }

  statement {
    sid       = "Targets"
    actions   = ["elasticloadbalancing:RegisterTargets", "elasticloadbalancing:DeregisterTargets"]
    resources = ["arn:${local.partition}:elasticloadbalancing:*:*:targetgroup/*/*"]
  }

  statement {
    sid = "ListenersAndRules"
    actions = [
      "elasticloadbalancing:SetWebAcl",
      "elasticloadbalancing:ModifyListener",
      "elasticloadbalancing:AddListenerCertificates",
      "elasticloadbalancing:RemoveListenerCertificates",
      "elasticloadbalancing:ModifyRule",
      "elasticloadbalancing:SetRulePriorities",
    ]
    resources = ["*"]
  }
}

# --- external-dns: records in the named hosted zones only ------------------------------------

data "aws_iam_policy_document" "external_dns" {
  #checkov:skip=CKV_AWS_356:ListHostedZones and ListTagsForResources take no resource ARNs; record changes are limited to the named zones.
  statement {
    sid       = "ChangeRecords"
    actions   = ["route53:ChangeResourceRecordSets", "route53:ListResourceRecordSets"]
    resources = [for id in var.route53_zone_ids : "arn:${local.partition}:route53:::hostedzone/${id}"]
  }

  statement {
    sid       = "ListZones"
    actions   = ["route53:ListHostedZones", "route53:ListTagsForResources"]
    resources = ["*"]
  }
}

# --- Fluent Bit: every container's log lines into one encrypted log group -----------------------

resource "aws_kms_key" "logs" {
  description             = "${var.cluster_name}: container logs"
  enable_key_rotation     = true
  deletion_window_in_days = 30

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountAdministration"
        Effect    = "Allow"
        Principal = { AWS = local.account_arn }
        Action    = "kms:*"
        Resource  = "*"
      },
      {
        Sid       = "CloudWatchLogs"
        Effect    = "Allow"
        Principal = { Service = "logs.${local.region}.amazonaws.com" }
        Action    = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
        Resource  = "*"
        Condition = {
          ArnEquals = {
            "kms:EncryptionContext:aws:logs:arn" = "arn:${local.partition}:logs:${local.region}:${local.account}:log-group:${local.log_group}"
          }
        }
      },
    ]
  })

  tags = var.tags
}

resource "aws_cloudwatch_log_group" "containers" {
  name              = local.log_group
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.logs.arn

  tags = var.tags
}

data "aws_iam_policy_document" "fluent_bit" {
  statement {
    sid       = "WriteContainerLogs"
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = [aws_cloudwatch_log_group.containers.arn, "${aws_cloudwatch_log_group.containers.arn}:log-stream:*"]
  }
}
