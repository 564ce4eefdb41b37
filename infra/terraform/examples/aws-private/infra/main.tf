# Stack 1 of 2, AWS only: the network, EKS (the API private, open on 443 to the runner's CIDR
# blocks or security groups), PostgreSQL, Redis, the bucket, Tokenmill's secrets in Secrets
# Manager and the add-ons' IAM roles. Nothing here talks to Kubernetes, so it applies from
# anywhere with AWS credentials. The platform stack (../platform) then installs the add-ons
# and Tokenmill into the cluster, reading this stack's outputs from its state.

data "aws_caller_identity" "current" {}

locals {
  bucket_name = coalesce(var.bucket_name, "${var.name}-${data.aws_caller_identity.current.account_id}-${var.region}")
  tags        = merge({ "app.kubernetes.io/part-of" = "tokenmill", Installation = var.name }, var.tags)
}

module "network" {
  source = "../../../modules/network"

  name               = var.name
  cidr               = var.vpc_cidr
  azs                = var.azs
  single_nat_gateway = var.single_nat_gateway
  tags               = local.tags
}

module "cluster" {
  source = "../../../modules/cluster"

  name                          = var.name
  kubernetes_version            = var.kubernetes_version
  subnet_ids                    = module.network.private_subnet_ids
  endpoint_public_access        = var.cluster_endpoint_public_access
  public_access_cidrs           = var.cluster_public_access_cidrs
  api_access_cidrs              = var.api_access_cidrs
  api_access_security_group_ids = var.api_access_security_group_ids
  admin_principal_arns          = var.cluster_admin_principal_arns
  system_node_group             = var.system_node_group
  tags                          = local.tags
}

module "database" {
  source = "../../../modules/database"

  name                       = "${var.name}-db"
  vpc_id                     = module.network.vpc_id
  subnet_ids                 = module.network.private_subnet_ids
  allowed_security_group_ids = [module.cluster.node_security_group_id]
  instance_class             = var.db_instance_class
  multi_az                   = var.db_multi_az
  backup_retention_days      = var.db_backup_retention_days
  deletion_protection        = var.db_deletion_protection
  tags                       = local.tags
}

module "cache" {
  source = "../../../modules/cache"

  name                       = "${var.name}-redis"
  vpc_id                     = module.network.vpc_id
  subnet_ids                 = module.network.private_subnet_ids
  allowed_security_group_ids = [module.cluster.node_security_group_id]
  node_type                  = var.redis_node_type
  num_cache_clusters         = var.redis_nodes
  tags                       = local.tags
}

module "storage" {
  source = "../../../modules/storage"

  bucket_name       = local.bucket_name
  oidc_provider_arn = module.cluster.oidc_provider_arn
  oidc_issuer       = module.cluster.oidc_issuer
  namespace         = var.namespace
  tags              = local.tags
}

module "secrets" {
  source = "../../../modules/secrets"

  name              = var.name
  oidc_provider_arn = module.cluster.oidc_provider_arn
  oidc_issuer       = module.cluster.oidc_issuer
  namespace         = var.namespace
  versions          = var.secret_versions
  # External Secrets also reads RDS's master user secret (for the migration Job only) and the
  # Redis users' secrets, each under its own module's key.
  readable_secret_arns  = concat([module.database.master_user_secret_arn], values(module.cache.user_secret_arns))
  readable_kms_key_arns = [module.database.kms_key_arn, module.cache.kms_key_arn]
  tags                  = local.tags
}

module "addons_aws" {
  source = "../../../modules/addons-aws"

  cluster_name       = module.cluster.name
  route53_zone_ids   = var.route53_zone_ids
  log_retention_days = var.log_retention_days
  tags               = local.tags

  # Pod Identity associations need the agent (an EKS add-on of modules/cluster).
  depends_on = [module.cluster]
}
