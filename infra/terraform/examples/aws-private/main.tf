# Tokenmill in a private AWS setup: VPC, EKS (system and GPU node groups), RDS PostgreSQL,
# ElastiCache Redis, an S3 bucket for weights and adapters, and Tokenmill itself on the
# cluster. Secrets are generated here and only ever stored in the (encrypted) state and in
# Kubernetes Secrets.

data "aws_caller_identity" "current" {}

locals {
  bucket_name = coalesce(var.bucket_name, "${var.name}-${data.aws_caller_identity.current.account_id}-${var.region}")
  tags        = merge({ "app.kubernetes.io/part-of" = "tokenmill", Installation = var.name }, var.tags)

  # AWS Load Balancer Controller: HTTPS only, TLS 1.2+, straight to the pods' IPs.
  alb_common = merge(
    {
      "alb.ingress.kubernetes.io/target-type"      = "ip"
      "alb.ingress.kubernetes.io/listen-ports"     = jsonencode([{ HTTPS = 443 }])
      "alb.ingress.kubernetes.io/ssl-policy"       = "ELBSecurityPolicy-TLS13-1-2-2021-06"
      "alb.ingress.kubernetes.io/healthcheck-path" = "/health"
      # Streams stay open while tokens are generated; drop malformed headers at the edge.
      "alb.ingress.kubernetes.io/load-balancer-attributes" = "idle_timeout.timeout_seconds=600,routing.http.drop_invalid_header_fields.enabled=true"
    },
    var.certificate_arn == null ? {} : { "alb.ingress.kubernetes.io/certificate-arn" = var.certificate_arn },
  )
}

# --- generated secrets --------------------------------------------------------------------

resource "random_password" "database" {
  length  = 40
  special = false
}

resource "random_password" "redis" {
  length  = 64
  special = false
}

resource "random_password" "internal_token" {
  length  = 64
  special = false
}

resource "random_password" "secret_key" {
  length  = 64
  special = false
}

# --- infrastructure ---------------------------------------------------------------------

module "network" {
  source = "../../modules/network"

  name               = var.name
  cidr               = var.vpc_cidr
  azs                = var.azs
  single_nat_gateway = var.single_nat_gateway
  tags               = local.tags
}

module "cluster" {
  source = "../../modules/cluster"

  name                   = var.name
  kubernetes_version     = var.kubernetes_version
  subnet_ids             = module.network.private_subnet_ids
  endpoint_public_access = var.cluster_endpoint_public_access
  public_access_cidrs    = var.cluster_public_access_cidrs
  admin_principal_arns   = var.cluster_admin_principal_arns
  system_node_group      = var.system_node_group
  gpu_node_groups        = var.gpu_node_groups
  tags                   = local.tags
}

module "database" {
  source = "../../modules/database"

  name                       = "${var.name}-db"
  vpc_id                     = module.network.vpc_id
  subnet_ids                 = module.network.private_subnet_ids
  allowed_security_group_ids = [module.cluster.node_security_group_id]
  instance_class             = var.db_instance_class
  multi_az                   = var.db_multi_az
  backup_retention_days      = var.db_backup_retention_days
  deletion_protection        = var.db_deletion_protection
  password                   = random_password.database.result
  tags                       = local.tags
}

module "cache" {
  source = "../../modules/cache"

  name                       = "${var.name}-redis"
  vpc_id                     = module.network.vpc_id
  subnet_ids                 = module.network.private_subnet_ids
  allowed_security_group_ids = [module.cluster.node_security_group_id]
  node_type                  = var.redis_node_type
  num_cache_clusters         = var.redis_nodes
  auth_token                 = random_password.redis.result
  tags                       = local.tags
}

module "storage" {
  source = "../../modules/storage"

  bucket_name       = local.bucket_name
  oidc_provider_arn = module.cluster.oidc_provider_arn
  oidc_issuer       = module.cluster.oidc_issuer
  namespace         = var.namespace
  tags              = local.tags
}

# --- Tokenmill ----------------------------------------------------------------------------

module "tokenmill" {
  source = "../../modules/tokenmill"

  namespace    = var.namespace
  image        = var.image
  worker_image = var.worker_image

  internal_token = random_password.internal_token.result
  secret_key     = random_password.secret_key.result
  # TLS to PostgreSQL (the parameter group refuses plain connections) and to Redis.
  database_url          = "postgresql+asyncpg://${module.database.username}:${urlencode(random_password.database.result)}@${module.database.address}:${module.database.port}/${module.database.database_name}?ssl=require"
  redis_url             = "rediss://:${urlencode(random_password.redis.result)}@${module.cache.primary_endpoint}:${module.cache.port}/0?ssl_cert_reqs=required"
  storage_url           = module.storage.storage_url
  s3_region             = module.storage.region
  stripe_api_key        = var.stripe_api_key
  stripe_webhook_secret = var.stripe_webhook_secret

  writer_role_arn  = module.storage.writer_role_arn
  reader_role_arn  = module.storage.reader_role_arn
  worker_gpu_types = module.cluster.gpu_types

  api_host = var.api_host
  api_ingress_annotations = merge(local.alb_common, {
    "alb.ingress.kubernetes.io/scheme"        = "internet-facing"
    "alb.ingress.kubernetes.io/inbound-cidrs" = join(",", var.api_allowed_cidrs)
    "alb.ingress.kubernetes.io/group.name"    = "${var.name}-api"
  })
  admin_host = var.admin_host
  admin_ingress_annotations = merge(local.alb_common, {
    "alb.ingress.kubernetes.io/scheme"     = "internal"
    "alb.ingress.kubernetes.io/group.name" = "${var.name}-admin"
  })

  settings = var.tokenmill_settings

  # Nodes, add-ons and the CNI must be up before pods (and the migration Job) can run.
  depends_on = [module.cluster]
}

check "ingress_certificate" {
  assert {
    condition     = (var.api_host == null && var.admin_host == null) || var.certificate_arn != null
    error_message = "api_host and admin_host need certificate_arn (an ACM certificate for the HTTPS listener)."
  }
}
