output "name" {
  description = "Name of the EKS cluster."
  value       = aws_eks_cluster.this.name
}

output "endpoint" {
  description = "URL of the Kubernetes API."
  value       = aws_eks_cluster.this.endpoint
}

output "certificate_authority_data" {
  description = "Base64 CA certificate of the Kubernetes API."
  value       = aws_eks_cluster.this.certificate_authority[0].data
}

output "node_security_group_id" {
  description = "Security group of the control plane and every node, Karpenter's included (the EKS cluster security group, tagged karpenter.sh/discovery); the database and the cache admit it."
  value       = aws_eks_cluster.this.vpc_config[0].cluster_security_group_id
}

output "oidc_provider_arn" {
  description = "ARN of the cluster's IAM OIDC provider (IRSA)."
  value       = aws_iam_openid_connect_provider.this.arn
}

output "oidc_issuer" {
  description = "OIDC issuer of the cluster without https:// (the prefix of IRSA trust conditions)."
  value       = local.oidc_issuer
}

output "node_role_arn" {
  description = "IAM role of the nodes."
  value       = aws_iam_role.node.arn
}

output "node_role_name" {
  description = "Name of the system nodes' IAM role."
  value       = aws_iam_role.node.name
}

output "kms_key_arn" {
  description = "KMS key of the cluster's secrets and logs."
  value       = aws_kms_key.cluster.arn
}
