terraform {
  # Write-only arguments (secret_string_wo) and ephemeral resources: the generated secrets
  # never reach the plan or the state.
  required_version = ">= 1.11.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = "~> 5.100"
    }
  }
}
