output "bucket" {
  description = "Name of the bucket."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "ARN of the bucket."
  value       = aws_s3_bucket.this.arn
}

output "storage_url" {
  description = "TOKENMILL_STORAGE_URL of the services and workers."
  value       = "s3://${aws_s3_bucket.this.id}/${var.prefix}"
}

output "region" {
  description = "Region of the bucket (TOKENMILL_S3_REGION)."
  value       = data.aws_region.current.name
}

output "writer_role_arn" {
  description = "IAM role of the service accounts that write objects (annotate them with eks.amazonaws.com/role-arn)."
  value       = aws_iam_role.this["writer"].arn
}

output "files_writer_role_arn" {
  description = "IAM role of the service accounts that read objects and write only under <prefix>/files/ (the gateways)."
  value       = aws_iam_role.this["files-writer"].arn
}

output "reader_role_arn" {
  description = "IAM role of the service accounts that only read objects."
  value       = aws_iam_role.this["reader"].arn
}

output "kms_key_arn" {
  description = "KMS key of the objects."
  value       = aws_kms_key.this.arn
}
