# What the platform stack reads (terraform_remote_state) and what operators need.

output "region" {
  description = "AWS region of everything."
  value       = var.region
}

output "cluster_name" {
  description = "Name of the EKS cluster."
  value       = module.cluster.name
}

output "cluster_endpoint" {
  description = "URL of the Kubernetes API (private unless cluster_endpoint_public_access)."
  value       = module.cluster.endpoint
}

output "cluster_certificate_authority_data" {
  description = "Base64 CA certificate of the Kubernetes API."
  value       = module.cluster.certificate_authority_data
}

output "kubeconfig_command" {
  description = "Adds the cluster to your kubeconfig."
  value       = "aws eks update-kubeconfig --region ${var.region} --name ${module.cluster.name}"
}

output "vpc_id" {
  description = "VPC of the cluster."
  value       = module.network.vpc_id
}

output "nat_public_ips" {
  description = "Addresses the cluster's outbound traffic comes from."
  value       = module.network.nat_public_ips
}

output "namespace" {
  description = "Namespace of Tokenmill (the IRSA roles trust its service accounts)."
  value       = var.namespace
}

output "storage" {
  description = "The bucket (TOKENMILL_STORAGE_URL, region) and the IRSA roles of its writers, its files/ writers and its readers."
  value = {
    url                   = module.storage.storage_url
    region                = module.storage.region
    writer_role_arn       = module.storage.writer_role_arn
    files_writer_role_arn = module.storage.files_writer_role_arn
    reader_role_arn       = module.storage.reader_role_arn
  }
}

output "database" {
  description = "PostgreSQL: host, port, database, and RDS's master user secret (the migrations' owner)."
  value = {
    address      = module.database.address
    port         = module.database.port
    name         = module.database.database_name
    owner_secret = module.database.master_user_secret_arn
  }
}

output "redis" {
  description = "Redis: primary endpoint, port and each component's user secret."
  value = {
    endpoint     = module.cache.primary_endpoint
    port         = module.cache.port
    user_secrets = module.cache.user_secret_arns
  }
}

output "secrets" {
  description = "Tokenmill's secrets in Secrets Manager (names) and the role External Secrets reads them with."
  value = {
    names           = module.secrets.secret_names
    reader_role_arn = module.secrets.reader_role_arn
  }
}

output "addons" {
  description = "What the platform stack's add-ons need: their service accounts (bound to IAM roles by Pod Identity), Karpenter's node role and interruption queue, the log group."
  value = {
    service_accounts             = module.addons_aws.service_accounts
    karpenter_node_role_name     = module.addons_aws.karpenter_node_role_name
    karpenter_interruption_queue = module.addons_aws.karpenter_interruption_queue
    log_group_name               = module.addons_aws.log_group_name
    external_dns                 = module.addons_aws.external_dns_enabled
  }
}
