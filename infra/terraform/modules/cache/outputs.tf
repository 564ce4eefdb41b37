output "primary_endpoint" {
  description = "Host name of the primary node (follows failovers)."
  value       = aws_elasticache_replication_group.this.primary_endpoint_address
}

output "reader_endpoint" {
  description = "Host name spreading reads over the replicas."
  value       = aws_elasticache_replication_group.this.reader_endpoint_address
}

output "port" {
  description = "Port of the cache (TLS)."
  value       = aws_elasticache_replication_group.this.port
}

output "security_group_id" {
  description = "Security group of the cache."
  value       = aws_security_group.this.id
}

output "kms_key_arn" {
  description = "KMS key of the cache's data and logs."
  value       = aws_kms_key.this.arn
}

output "users" {
  description = "Redis user name of each component (the user part of its rediss:// URL)."
  value       = { for name, user in aws_elasticache_user.this : name => user.user_name }
}

output "user_secret_arns" {
  description = "Secrets Manager secret of each component's Redis user (JSON: username, password)."
  value       = { for name, secret in aws_secretsmanager_secret.user : name => secret.arn }
}
