provider "aws" {
  region = var.region

  default_tags {
    tags = local.tags
  }
}

# Talks to the cluster this configuration creates, with a short-lived token from the AWS
# CLI (the identity running Terraform is a cluster admin: modules/cluster grant_creator_admin).
provider "kubernetes" {
  host                   = module.cluster.endpoint
  cluster_ca_certificate = base64decode(module.cluster.certificate_authority_data)

  exec {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", module.cluster.name, "--region", var.region]
  }
}
