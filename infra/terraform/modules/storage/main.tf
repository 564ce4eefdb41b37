# A private S3 bucket for model weights, LoRA adapters, billing exports and the files of
# /v1/files: encrypted with its own KMS key, versioned, TLS only, access-logged; and three IAM
# roles for service accounts (IRSA), each reading the whole prefix: one that writes anywhere
# under it, one that writes only under its files/, one that only reads.

data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}
data "aws_region" "current" {}

locals {
  partition   = data.aws_partition.current.partition
  account_arn = "arn:${local.partition}:iam::${data.aws_caller_identity.current.account_id}:root"
  objects     = "${aws_s3_bucket.this.arn}/${var.prefix}/*"
  log_bucket  = "${var.bucket_name}-logs"
  roles = {
    writer         = var.writer_service_accounts
    "files-writer" = var.files_writer_service_accounts
    reader         = var.reader_service_accounts
  }
  # Where each role may create, replace and delete objects. files/ holds the uploads of
  # /v1/files and batches' output files (control_plane/files/models.py file_key): the gateway
  # writes there and must not touch weights, adapters or exports.
  writes = {
    writer         = [local.objects]
    "files-writer" = ["${aws_s3_bucket.this.arn}/${var.prefix}/files/*"]
    reader         = []
  }
}

resource "aws_kms_key" "this" {
  description             = "${var.bucket_name}: objects"
  enable_key_rotation     = true
  deletion_window_in_days = 30

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      {
        Sid       = "AccountAdministration"
        Effect    = "Allow"
        Principal = { AWS = local.account_arn }
        Action    = "kms:*"
        Resource  = "*"
      },
    ]
  })

  tags = var.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.bucket_name}"
  target_key_id = aws_kms_key.this.key_id
}

# --- the bucket -----------------------------------------------------------------------

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_144:Cross-region replication needs a bucket and a provider in a second region, which this single-region module does not own; weights and adapters can be uploaded again and exports regenerated from PostgreSQL. Add a replication rule in the calling configuration where a second region is required.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events: Tokenmill records every object it writes in PostgreSQL.
  bucket        = var.bucket_name
  force_destroy = var.force_destroy

  tags = var.tags
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "expire-old-versions"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

resource "aws_s3_bucket_logging" "this" {
  bucket        = aws_s3_bucket.this.id
  target_bucket = aws_s3_bucket.logs.id
  target_prefix = "s3/${var.bucket_name}/"
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.this.arn, "${aws_s3_bucket.this.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  depends_on = [aws_s3_bucket_public_access_block.this]
}

# --- the access-log bucket -------------------------------------------------------------

resource "aws_s3_bucket" "logs" {
  #checkov:skip=CKV_AWS_18:This is the access-log bucket; logging it into itself would log its own log deliveries forever.
  #checkov:skip=CKV_AWS_144:Access logs stay in the region they describe; replicating them elsewhere is a compliance choice of the calling configuration.
  #checkov:skip=CKV_AWS_145:S3 server access logs can only be delivered to a bucket encrypted with SSE-S3 (AES256), not SSE-KMS.
  #checkov:skip=CKV2_AWS_62:Nothing consumes log-delivery events.
  bucket        = local.log_bucket
  force_destroy = var.force_destroy

  tags = var.tags
}

resource "aws_s3_bucket_ownership_controls" "logs" {
  bucket = aws_s3_bucket.logs.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "logs" {
  bucket = aws_s3_bucket.logs.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "logs" {
  bucket = aws_s3_bucket.logs.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "logs" {
  bucket = aws_s3_bucket.logs.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "logs" {
  bucket = aws_s3_bucket.logs.id

  rule {
    id     = "expire-logs"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }

    expiration {
      days = var.access_log_days
    }

    noncurrent_version_expiration {
      noncurrent_days = 1
    }
  }

  depends_on = [aws_s3_bucket_versioning.logs]
}

data "aws_iam_policy_document" "logs" {
  statement {
    sid       = "S3ServerAccessLogs"
    actions   = ["s3:PutObject"]
    resources = ["${aws_s3_bucket.logs.arn}/s3/*"]

    principals {
      type        = "Service"
      identifiers = ["logging.s3.amazonaws.com"]
    }

    condition {
      test     = "ArnLike"
      variable = "aws:SourceArn"
      values   = [aws_s3_bucket.this.arn]
    }

    condition {
      test     = "StringEquals"
      variable = "aws:SourceAccount"
      values   = [data.aws_caller_identity.current.account_id]
    }
  }

  statement {
    sid       = "DenyInsecureTransport"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.logs.arn, "${aws_s3_bucket.logs.arn}/*"]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "logs" {
  bucket = aws_s3_bucket.logs.id
  policy = data.aws_iam_policy_document.logs.json

  depends_on = [aws_s3_bucket_public_access_block.logs]
}

# --- IAM roles for service accounts ------------------------------------------------------

data "aws_iam_policy_document" "assume" {
  for_each = local.roles

  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [var.oidc_provider_arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:sub"
      values   = [for account in each.value : "system:serviceaccount:${var.namespace}:${account}"]
    }

    condition {
      test     = "StringEquals"
      variable = "${var.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "this" {
  for_each = local.roles

  name_prefix        = "${substr(var.bucket_name, 0, 20)}-${each.key}-"
  description        = "Tokenmill ${each.key} of s3://${var.bucket_name}/${var.prefix} (IRSA)"
  assume_role_policy = data.aws_iam_policy_document.assume[each.key].json

  tags = var.tags
}

data "aws_iam_policy_document" "access" {
  for_each = local.roles

  statement {
    sid       = "ListThePrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.prefix, "${var.prefix}/*"]
    }
  }

  statement {
    sid       = "ReadObjects"
    actions   = ["s3:GetObject"]
    resources = [local.objects]
  }

  # PutObject also covers a multipart upload's create, parts and completion (boto3's
  # upload_fileobj of a large object); aborting and listing parts are actions of their own.
  dynamic "statement" {
    for_each = length(local.writes[each.key]) > 0 ? [local.writes[each.key]] : []

    content {
      sid = "WriteObjects"
      actions = [
        "s3:PutObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
        "s3:ListMultipartUploadParts",
      ]
      resources = statement.value
    }
  }

  statement {
    sid       = "BucketKey"
    actions   = length(local.writes[each.key]) > 0 ? ["kms:Decrypt", "kms:GenerateDataKey"] : ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role_policy" "this" {
  for_each = local.roles

  name   = "s3-${each.key}"
  role   = aws_iam_role.this[each.key].id
  policy = data.aws_iam_policy_document.access[each.key].json
}
