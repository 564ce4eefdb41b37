output "address" {
  description = "Host name of the database."
  value       = aws_db_instance.this.address
}

output "port" {
  description = "Port of the database."
  value       = aws_db_instance.this.port
}

output "database_name" {
  description = "Name of Tokenmill's database."
  value       = aws_db_instance.this.db_name
}

output "username" {
  description = "Master user name (the migrations' owner)."
  value       = aws_db_instance.this.username
}

output "master_user_secret_arn" {
  description = "Secrets Manager secret RDS keeps the master user's credentials in (JSON: username, password); the migration Job reads it."
  value       = aws_db_instance.this.master_user_secret[0].secret_arn
}

output "security_group_id" {
  description = "Security group of the database."
  value       = aws_security_group.this.id
}

output "instance_id" {
  description = "Identifier of the RDS instance."
  value       = aws_db_instance.this.identifier
}

output "kms_key_arn" {
  description = "KMS key of the database's storage, Performance Insights, logs and master user secret."
  value       = aws_kms_key.this.arn
}
