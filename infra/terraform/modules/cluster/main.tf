# EKS with a private API endpoint (reachable from the runner's CIDR blocks or security groups),
# encrypted secrets, every control plane log, the IAM OIDC provider (IRSA) and the Pod Identity
# agent, and a managed `system` node group (AMI release pinned) for the services and the
# add-ons. GPU nodes are not made here: Karpenter launches them (modules/addons-aws,
# modules/addons) with the label and taint the worker pods select and tolerate
# (autoscaler/kubernetes.py): tokenmill.dev/gpu-type=<gpu type>, nvidia.com/gpu=present:NoSchedule.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  partition   = data.aws_partition.current.partition
  account_arn = "arn:${local.partition}:iam::${data.aws_caller_identity.current.account_id}:root"
  log_group   = "/aws/eks/${var.name}/cluster"
  oidc_issuer = trimprefix(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://")

  system = {
    instance_types = var.system_node_group.instance_types
    min_size       = var.system_node_group.min_size
    max_size       = var.system_node_group.max_size
    desired_size   = var.system_node_group.desired_size
    disk_size_gib  = var.system_node_group.disk_size_gib
    labels         = { "tokenmill.dev/pool" = "system" }
  }
}

# --- encryption and logs --------------------------------------------------------------

resource "aws_kms_key" "cluster" {
  description             = "${var.name}: EKS secrets and control plane logs"
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
        Principal = { Service = "logs.${data.aws_region.current.name}.amazonaws.com" }
        Action    = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
        Resource  = "*"
        Condition = {
          ArnEquals = {
            "kms:EncryptionContext:aws:logs:arn" = "arn:${local.partition}:logs:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:log-group:${local.log_group}"
          }
        }
      },
    ]
  })

  tags = var.tags
}

resource "aws_kms_alias" "cluster" {
  name          = "alias/${var.name}-eks"
  target_key_id = aws_kms_key.cluster.key_id
}

# Created before the cluster so EKS writes into an encrypted group with a retention.
resource "aws_cloudwatch_log_group" "cluster" {
  name              = local.log_group
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.cluster.arn

  tags = var.tags
}

# --- control plane --------------------------------------------------------------------

data "aws_iam_policy_document" "cluster_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]

    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  name_prefix        = "${substr(var.name, 0, 20)}-cluster-"
  assume_role_policy = data.aws_iam_policy_document.cluster_assume.json

  tags = var.tags
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

data "aws_iam_policy_document" "cluster_encryption" {
  statement {
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ListGrants", "kms:DescribeKey"]
    resources = [aws_kms_key.cluster.arn]
  }
}

resource "aws_iam_role_policy" "cluster_encryption" {
  name   = "encrypt-secrets"
  role   = aws_iam_role.cluster.id
  policy = data.aws_iam_policy_document.cluster_encryption.json
}

resource "aws_eks_cluster" "this" {
  name     = var.name
  version  = var.kubernetes_version
  role_arn = aws_iam_role.cluster.arn

  enabled_cluster_log_types = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  vpc_config {
    subnet_ids              = var.subnet_ids
    endpoint_private_access = true
    endpoint_public_access  = var.endpoint_public_access
    public_access_cidrs     = var.endpoint_public_access ? var.public_access_cidrs : null
  }

  access_config {
    authentication_mode                         = "API"
    bootstrap_cluster_creator_admin_permissions = var.grant_creator_admin
  }

  encryption_config {
    resources = ["secrets"]

    provider {
      key_arn = aws_kms_key.cluster.arn
    }
  }

  tags = merge(var.tags, { "karpenter.sh/discovery" = var.name })

  lifecycle {
    # With no CIDR, EKS would open a public endpoint to 0.0.0.0/0.
    precondition {
      condition     = !var.endpoint_public_access || length(var.public_access_cidrs) > 0
      error_message = "endpoint_public_access needs public_access_cidrs (the addresses allowed to reach the API)."
    }
  }

  depends_on = [
    aws_cloudwatch_log_group.cluster,
    aws_iam_role_policy_attachment.cluster,
    aws_iam_role_policy.cluster_encryption,
  ]
}

# The runner that applies the platform stack (CI inside the VPC, a VPN, a peered network)
# reaches the private API endpoint on 443: by CIDR block or by security group.
resource "aws_vpc_security_group_ingress_rule" "api_from_cidr" {
  for_each = toset(var.api_access_cidrs)

  security_group_id = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
  description       = "Kubernetes API from ${each.value} (Terraform runner, operators)"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = each.value

  tags = var.tags
}

resource "aws_vpc_security_group_ingress_rule" "api_from_security_group" {
  for_each = toset(var.api_access_security_group_ids)

  security_group_id            = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
  description                  = "Kubernetes API from ${each.value} (Terraform runner, operators)"
  ip_protocol                  = "tcp"
  from_port                    = 443
  to_port                      = 443
  referenced_security_group_id = each.value

  tags = var.tags
}

# Karpenter's GPU nodes join the security group every node and the control plane share (the
# database and the cache admit it).
resource "aws_ec2_tag" "cluster_security_group_discovery" {
  resource_id = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
  key         = "karpenter.sh/discovery"
  value       = var.name
}

resource "aws_eks_access_entry" "admin" {
  for_each = toset(var.admin_principal_arns)

  cluster_name  = aws_eks_cluster.this.name
  principal_arn = each.value
  type          = "STANDARD"

  tags = var.tags
}

resource "aws_eks_access_policy_association" "admin" {
  for_each = toset(var.admin_principal_arns)

  cluster_name  = aws_eks_cluster.this.name
  principal_arn = aws_eks_access_entry.admin[each.value].principal_arn
  policy_arn    = "arn:${local.partition}:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"

  access_scope {
    type = "cluster"
  }
}

# --- IAM roles for service accounts (IRSA) ----------------------------------------------

# No thumbprint: IAM trusts the EKS OIDC issuer through its own certificate authorities.
resource "aws_iam_openid_connect_provider" "this" {
  url            = aws_eks_cluster.this.identity[0].oidc[0].issuer
  client_id_list = ["sts.amazonaws.com"]

  tags = var.tags
}

# The VPC CNI gets its EC2 permissions through its own service account, not the nodes' role.
data "aws_iam_policy_document" "vpc_cni_assume" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [aws_iam_openid_connect_provider.this.arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:kube-system:aws-node"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "vpc_cni" {
  name_prefix        = "${substr(var.name, 0, 20)}-vpc-cni-"
  assume_role_policy = data.aws_iam_policy_document.vpc_cni_assume.json

  tags = var.tags
}

resource "aws_iam_role_policy_attachment" "vpc_cni" {
  role       = aws_iam_role.vpc_cni.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonEKS_CNI_Policy"
}

resource "aws_eks_addon" "vpc_cni" {
  cluster_name                = aws_eks_cluster.this.name
  addon_name                  = "vpc-cni"
  service_account_role_arn    = aws_iam_role.vpc_cni.arn
  resolve_conflicts_on_create = "OVERWRITE"
  resolve_conflicts_on_update = "OVERWRITE"
  # NetworkPolicy enforcement (the tokenmill module keeps workers reachable from Tokenmill only).
  configuration_values = jsonencode({ enableNetworkPolicy = "true" })

  tags = var.tags

  depends_on = [aws_iam_role_policy_attachment.vpc_cni]
}

# --- nodes ----------------------------------------------------------------------------

data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name_prefix        = "${substr(var.name, 0, 20)}-node-"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json

  tags = var.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset(["AmazonEKSWorkerNodePolicy", "AmazonEC2ContainerRegistryReadOnly"])

  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/${each.value}"
}

resource "aws_launch_template" "node" {
  name_prefix            = "${var.name}-system-"
  description            = "${var.name} system nodes: IMDSv2 only, encrypted volumes"
  update_default_version = true

  # IMDSv2 only, one hop: pods cannot reach the node's instance role; they use IRSA.
  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  block_device_mappings {
    device_name = "/dev/xvda"

    ebs {
      volume_size           = local.system.disk_size_gib
      volume_type           = "gp3"
      encrypted             = true
      delete_on_termination = true
    }
  }

  monitoring {
    enabled = true
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = "${var.name}-system" })
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(var.tags, { Name = "${var.name}-system" })
  }

  tags = var.tags
}

# The services and the add-ons (Karpenter itself included) run here; GPU nodes come from
# Karpenter. The AMI release is pinned: nodes change only when release_version does.
resource "aws_eks_node_group" "system" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "system"
  version         = var.kubernetes_version
  release_version = var.system_node_group.release_version
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = var.subnet_ids
  ami_type        = "AL2023_x86_64_STANDARD"
  capacity_type   = "ON_DEMAND"
  instance_types  = local.system.instance_types
  labels          = local.system.labels

  scaling_config {
    min_size     = local.system.min_size
    max_size     = local.system.max_size
    desired_size = local.system.desired_size
  }

  update_config {
    max_unavailable = 1
  }

  launch_template {
    id      = aws_launch_template.node.id
    version = aws_launch_template.node.latest_version
  }

  tags = var.tags

  lifecycle {
    precondition {
      condition     = startswith(var.system_node_group.release_version, "${var.kubernetes_version}.")
      error_message = "system_node_group.release_version must be an AMI release of kubernetes_version (e.g. ${var.kubernetes_version}.x-YYYYMMDD)."
    }
  }

  depends_on = [
    aws_iam_role_policy_attachment.node,
    aws_eks_addon.vpc_cni,
  ]
}

resource "aws_eks_addon" "this" {
  for_each = var.addons

  cluster_name                = aws_eks_cluster.this.name
  addon_name                  = each.key
  addon_version               = each.value.version
  resolve_conflicts_on_create = "OVERWRITE"
  resolve_conflicts_on_update = "OVERWRITE"

  tags = var.tags

  # coredns and metrics-server need nodes to become healthy.
  depends_on = [aws_eks_node_group.system]
}
