terraform {
  required_version = ">= 1.10.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.70"
    }
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 2.31"
    }
    random = {
      source  = "hashicorp/random"
      version = "~> 3.6"
    }
    tls = {
      source  = "hashicorp/tls"
      version = "~> 4.0"
    }
  }

  # The state holds the generated secrets (database password, Redis token, internal token,
  # secret key): keep it in an encrypted, versioned, private bucket (S3-native locking needs
  # Terraform 1.10). Partial configuration:
  #   terraform init -backend-config=backend.hcl   (see backend.hcl.example)
  backend "s3" {}
}
