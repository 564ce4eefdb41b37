# Stack 2 of 2: the add-ons and Tokenmill, in the cluster the infra stack (../infra) made. Its
# outputs come from its state (terraform_remote_state), never copied by hand.

data "terraform_remote_state" "infra" {
  backend = "s3"

  config = {
    bucket = var.infra_state.bucket
    key    = var.infra_state.key
    region = var.infra_state.region
  }
}

locals {
  infra = data.terraform_remote_state.infra.outputs

  # AWS Load Balancer Controller: HTTPS only, TLS 1.2+, straight to the pods' IPs.
  alb_common = merge(
    {
      "alb.ingress.kubernetes.io/target-type"      = "ip"
      "alb.ingress.kubernetes.io/listen-ports"     = jsonencode([{ HTTPS = 443 }])
      "alb.ingress.kubernetes.io/ssl-policy"       = "ELBSecurityPolicy-TLS13-1-2-2021-06"
      "alb.ingress.kubernetes.io/healthcheck-path" = "/health"
      # Streams stay open while tokens are generated (up to max_stream_seconds); drop
      # malformed headers at the edge.
      "alb.ingress.kubernetes.io/load-balancer-attributes" = "idle_timeout.timeout_seconds=${max(var.max_stream_seconds, 60)},routing.http.drop_invalid_header_fields.enabled=true"
    },
    var.certificate_arn == null ? {} : { "alb.ingress.kubernetes.io/certificate-arn" = var.certificate_arn },
  )
}

# --- GPU nodes and what a worker may ask of them ---------------------------------------------

module "gpu_pools" {
  source = "../../../modules/gpu-pools"

  cluster_name   = local.infra.cluster_name
  node_role_name = local.infra.addons.karpenter_node_role_name
  pools          = { for t, p in var.gpu_pools : t => { instance_types = p.instance_types, disk_gib = p.disk_gib, capacity_types = p.capacity_types, max_gpus = p.max_gpus } }
  ami_family     = var.gpu_ami.family
  ami_version    = var.gpu_ami.version
}

# Fails the plan when a worker pod (one GPU's share x its GPUs) would not fit a node type.
module "worker_sizing" {
  source = "../../../modules/worker-sizing"

  pools              = { for t, p in var.gpu_pools : t => { instance_types = p.instance_types, disk_gib = p.disk_gib, share = p.share } }
  daemonset_requests = module.addons.gpu_node_daemonset_requests
}

# --- add-ons ---------------------------------------------------------------------------------

module "addons" {
  source = "../../../modules/addons"

  cluster_name                 = local.infra.cluster_name
  region                       = local.infra.region
  vpc_id                       = local.infra.vpc_id
  service_accounts             = local.infra.addons.service_accounts
  karpenter_interruption_queue = local.infra.addons.karpenter_interruption_queue
  gpu_pool_manifests           = module.gpu_pools.manifests
  install_device_plugin        = module.gpu_pools.needs_device_plugin
  log_group_name               = local.infra.addons.log_group_name
  external_dns                 = local.infra.addons.external_dns ? { domain_filters = var.dns_domains } : null
}

# --- Tokenmill -------------------------------------------------------------------------------

module "tokenmill" {
  source = "../../../modules/tokenmill"

  namespace    = local.infra.namespace
  image        = var.image
  worker_image = var.worker_image
  vllm_image   = var.vllm_image # null: the module's default

  secret_store = { region = local.infra.region, role_arn = local.infra.secrets.reader_role_arn }
  secrets = {
    internal_token = local.infra.secrets.names["internal-token"]
    worker_token   = local.infra.secrets.names["worker-token"]
    secret_key     = local.infra.secrets.names["secret-key"]
    database_app   = local.infra.secrets.names["database-app"]
    stripe         = local.infra.secrets.names["stripe"]
  }
  database    = local.infra.database
  redis       = local.infra.redis
  storage_url = local.infra.storage.url
  s3_region   = local.infra.storage.region

  writer_role_arn       = local.infra.storage.writer_role_arn
  files_writer_role_arn = local.infra.storage.files_writer_role_arn
  reader_role_arn       = local.infra.storage.reader_role_arn

  worker_gpu_types     = module.gpu_pools.gpu_types
  worker_resources     = module.worker_sizing.worker_resources
  max_stream_seconds   = var.max_stream_seconds
  monitoring_namespace = module.addons.monitoring_namespace

  api_host = var.api_host
  api_ingress_annotations = merge(local.alb_common, {
    "alb.ingress.kubernetes.io/scheme"        = "internet-facing"
    "alb.ingress.kubernetes.io/inbound-cidrs" = join(",", var.api_allowed_cidrs)
    "alb.ingress.kubernetes.io/group.name"    = "${local.infra.cluster_name}-api"
  })
  admin_host = var.admin_host
  admin_ingress_annotations = merge(local.alb_common, {
    "alb.ingress.kubernetes.io/scheme"     = "internal"
    "alb.ingress.kubernetes.io/group.name" = "${local.infra.cluster_name}-admin"
  })

  settings = var.tokenmill_settings

  # The controllers and CRDs (External Secrets, the Prometheus operator, the load balancer
  # controller's readiness-gate webhook, Karpenter) come first.
  depends_on = [module.addons]
}

check "ingress_certificate" {
  assert {
    condition     = (var.api_host == null && var.admin_host == null) || var.certificate_arn != null
    error_message = "api_host and admin_host need certificate_arn (an ACM certificate for the HTTPS listener)."
  }
}
