variable "cluster_name" {
  description = "Name of the EKS cluster."
  type        = string
}

variable "region" {
  description = "AWS region of the cluster (the controllers get it explicitly: pods cannot reach the instance metadata)."
  type        = string
}

variable "vpc_id" {
  description = "VPC of the cluster (the AWS Load Balancer Controller's --aws-vpc-id)."
  type        = string
}

variable "service_accounts" {
  description = "Namespace and service account of each add-on, as modules/addons-aws bound them to their IAM roles (its service_accounts output)."
  type        = map(object({ namespace = string, name = string }))
}

variable "karpenter_interruption_queue" {
  description = "SQS queue of the interruption events (modules/addons-aws)."
  type        = string
}

variable "gpu_pool_manifests" {
  description = "Karpenter EC2NodeClasses and NodePools (modules/gpu-pools manifests)."
  type        = any
}

variable "install_device_plugin" {
  description = "Install the NVIDIA device plugin on the GPU nodes (modules/gpu-pools needs_device_plugin: the AL2023 NVIDIA AMI lacks it, Bottlerocket's has it)."
  type        = bool
  default     = false
}

variable "external_dns" {
  description = "external-dns: the domains it may write records in (the zones' names); null: not installed."
  type = object({
    domain_filters = list(string)
  })
  default = null
}

variable "log_group_name" {
  description = "CloudWatch Logs group Fluent Bit writes to (modules/addons-aws)."
  type        = string
}

variable "prometheus_retention" {
  description = "How long Prometheus keeps samples (in the pod's own volume: lost when it moves; use remote_write for more)."
  type        = string
  default     = "3d"
}

variable "chart_versions" {
  description = "Helm chart version of each add-on (pinned; raise deliberately)."
  type = object({
    aws_load_balancer_controller = optional(string, "1.13.0")
    karpenter                    = optional(string, "1.5.0")
    external_dns                 = optional(string, "1.16.1")
    kube_prometheus_stack        = optional(string, "72.0.0")
    dcgm_exporter                = optional(string, "4.1.1")
    fluent_bit                   = optional(string, "0.48.0")
    external_secrets             = optional(string, "0.17.0")
    nvidia_device_plugin         = optional(string, "0.17.1")
  })
  default = {}
}
