# ElastiCache Redis for the rate limits, the budget holds, the event bus (Streams) and the
# Celery broker: private, TLS in transit with an AUTH token, encrypted at rest with its
# own key, a replica in another zone with automatic failover.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  partition   = data.aws_partition.current.partition
  account_arn = "arn:${local.partition}:iam::${data.aws_caller_identity.current.account_id}:root"
  log_prefix  = "/aws/elasticache/${var.name}"
  log_types   = toset(["slow-log", "engine-log"])
  failover    = var.num_cache_clusters > 1
}

resource "aws_kms_key" "this" {
  description             = "${var.name}: ElastiCache data and logs"
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
          ArnLike = {
            "kms:EncryptionContext:aws:logs:arn" = "arn:${local.partition}:logs:${data.aws_region.current.name}:${data.aws_caller_identity.current.account_id}:log-group:${local.log_prefix}/*"
          }
        }
      },
    ]
  })

  tags = var.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.name}-redis"
  target_key_id = aws_kms_key.this.key_id
}

resource "aws_cloudwatch_log_group" "this" {
  for_each = local.log_types

  name              = "${local.log_prefix}/${each.key}"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn

  tags = var.tags
}

resource "aws_elasticache_subnet_group" "this" {
  name        = var.name
  description = "${var.name}: private subnets"
  subnet_ids  = var.subnet_ids

  tags = var.tags
}

resource "aws_security_group" "this" {
  name_prefix = "${var.name}-redis-"
  description = "${var.name}: Redis from the cluster only"
  vpc_id      = var.vpc_id

  tags = merge(var.tags, { Name = "${var.name}-redis" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "redis" {
  count = length(var.allowed_security_group_ids)

  security_group_id            = aws_security_group.this.id
  description                  = "Redis (TLS) from the cluster"
  ip_protocol                  = "tcp"
  from_port                    = 6379
  to_port                      = 6379
  referenced_security_group_id = var.allowed_security_group_ids[count.index]

  tags = var.tags
}

resource "aws_elasticache_replication_group" "this" {
  replication_group_id = var.name
  description          = "Tokenmill: rate limits, budgets, event bus, Celery broker"
  engine               = "redis"
  engine_version       = var.engine_version
  node_type            = var.node_type
  port                 = 6379
  num_cache_clusters   = var.num_cache_clusters

  subnet_group_name  = aws_elasticache_subnet_group.this.name
  security_group_ids = [aws_security_group.this.id]

  automatic_failover_enabled = local.failover
  multi_az_enabled           = local.failover

  at_rest_encryption_enabled = true
  kms_key_id                 = aws_kms_key.this.arn
  transit_encryption_enabled = true
  auth_token                 = var.auth_token

  auto_minor_version_upgrade = true
  maintenance_window         = var.maintenance_window
  snapshot_retention_limit   = var.snapshot_retention_days
  apply_immediately          = false

  dynamic "log_delivery_configuration" {
    for_each = local.log_types

    content {
      destination      = aws_cloudwatch_log_group.this[log_delivery_configuration.value].name
      destination_type = "cloudwatch-logs"
      log_format       = "json"
      log_type         = log_delivery_configuration.value
    }
  }

  tags = var.tags
}
