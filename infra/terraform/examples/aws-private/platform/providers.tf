# The cluster the infra stack made, with a short-lived token from the AWS CLI. Whoever applies
# this stack must reach the API (the infra stack's api_access_cidrs / api_access_security_group_ids,
# or its public endpoint) and be a cluster admin (the identity that applied the infra stack is;
# others: its cluster_admin_principal_arns).
locals {
  cluster = data.terraform_remote_state.infra.outputs
}

provider "kubernetes" {
  host                   = local.cluster.cluster_endpoint
  cluster_ca_certificate = base64decode(local.cluster.cluster_certificate_authority_data)

  exec {
    api_version = "client.authentication.k8s.io/v1beta1"
    command     = "aws"
    args        = ["eks", "get-token", "--cluster-name", local.cluster.cluster_name, "--region", local.cluster.region]
  }
}

provider "helm" {
  kubernetes {
    host                   = local.cluster.cluster_endpoint
    cluster_ca_certificate = base64decode(local.cluster.cluster_certificate_authority_data)

    exec {
      api_version = "client.authentication.k8s.io/v1beta1"
      command     = "aws"
      args        = ["eks", "get-token", "--cluster-name", local.cluster.cluster_name, "--region", local.cluster.region]
    }
  }
}
