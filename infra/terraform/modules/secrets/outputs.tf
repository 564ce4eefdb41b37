output "secret_arns" {
  description = "ARN of each of Tokenmill's secrets: internal-token, worker-token, secret-key, database-app, stripe."
  value = merge(
    { for key, secret in aws_secretsmanager_secret.generated : key => secret.arn },
    { database-app = aws_secretsmanager_secret.database_app.arn, stripe = aws_secretsmanager_secret.stripe.arn },
  )
}

output "secret_names" {
  description = "Name of each of Tokenmill's secrets (what an ExternalSecret's remoteRef.key names)."
  value = merge(
    { for key, secret in aws_secretsmanager_secret.generated : key => secret.name },
    { database-app = aws_secretsmanager_secret.database_app.name, stripe = aws_secretsmanager_secret.stripe.name },
  )
}

output "reader_role_arn" {
  description = "IAM role External Secrets assumes for Tokenmill's SecretStore (IRSA annotation of its service account)."
  value       = aws_iam_role.reader.arn
}

output "app_database_username" {
  description = "PostgreSQL role of the services."
  value       = var.app_database_username
}

output "kms_key_arn" {
  description = "KMS key of Tokenmill's secrets."
  value       = aws_kms_key.this.arn
}
