terraform {
  # Write-only arguments and ephemeral resources (modules/secrets): generated secrets never
  # reach the state. S3-native state locking needs 1.10.
  required_version = ">= 1.11.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.100"
    }
  }

  # Partial configuration: terraform init -backend-config=backend.hcl (see backend.hcl.example).
  # The platform stack reads this state's outputs (terraform_remote_state).
  backend "s3" {}
}
