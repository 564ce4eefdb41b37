output "role_arns" {
  description = "IAM role of each add-on (karpenter, aws-load-balancer-controller, fluent-bit, external-dns when zones are given), bound to its service account by EKS Pod Identity."
  value       = { for name, role in aws_iam_role.addon : name => role.arn }
}

output "service_accounts" {
  description = "Namespace and service account each add-on must run as (modules/addons installs them so)."
  value       = local.service_accounts
}

output "karpenter_node_role_name" {
  description = "IAM role of the nodes Karpenter launches (EC2NodeClass spec.role)."
  value       = aws_iam_role.karpenter_node.name
}

output "karpenter_interruption_queue" {
  description = "SQS queue of the interruption events (Karpenter's settings.interruptionQueue)."
  value       = aws_sqs_queue.interruption.name
}

output "log_group_name" {
  description = "CloudWatch Logs group Fluent Bit writes every container's log lines to."
  value       = aws_cloudwatch_log_group.containers.name
}

output "external_dns_enabled" {
  description = "Whether external-dns has a role (route53_zone_ids given)."
  value       = length(var.route53_zone_ids) > 0
}
