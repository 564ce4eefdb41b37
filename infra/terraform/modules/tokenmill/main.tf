# Tokenmill on Kubernetes: the namespace, settings and secrets, the migration Job, the
# Deployments of the gateway, control plane, Celery worker and beat and the worker
# autoscaler, their Services, Ingresses, the gateway's HorizontalPodAutoscaler, and the
# worker templates: the Deployment the autoscaler creates for each model deployment.

locals {
  home = "/var/lib/tokenmill"

  service_accounts = {
    gateway       = "tokenmill-gateway"
    control_plane = "tokenmill-control-plane"
    billing       = "tokenmill-billing"
    autoscaler    = "tokenmill-autoscaler"
    migrate       = "tokenmill-migrate"
    worker        = "tokenmill-worker" # fixed by the manifest contract (autoscaler/kubernetes.py)
  }
  role_arns = {
    gateway       = var.reader_role_arn
    control_plane = var.writer_role_arn
    billing       = var.writer_role_arn
    autoscaler    = null
    migrate       = null
    worker        = var.reader_role_arn
  }

  app_secret    = "tokenmill"
  worker_secret = "tokenmill-worker" # TOKENMILL_WORKER_SECRET's default
  settings_name = "tokenmill"

  labels = {
    gateway       = { "app.kubernetes.io/name" = "tokenmill-gateway", "app.kubernetes.io/component" = "gateway" }
    control_plane = { "app.kubernetes.io/name" = "tokenmill-control-plane", "app.kubernetes.io/component" = "control-plane" }
    celery_worker = { "app.kubernetes.io/name" = "tokenmill-celery-worker", "app.kubernetes.io/component" = "celery-worker" }
    celery_beat   = { "app.kubernetes.io/name" = "tokenmill-celery-beat", "app.kubernetes.io/component" = "celery-beat" }
    autoscaler    = { "app.kubernetes.io/name" = "tokenmill-autoscaler", "app.kubernetes.io/component" = "autoscaler" }
    migrate       = { "app.kubernetes.io/name" = "tokenmill-migrate", "app.kubernetes.io/component" = "migrate" }
  }
  common_labels = {
    "app.kubernetes.io/part-of"    = "tokenmill"
    "app.kubernetes.io/managed-by" = "terraform"
  }

  settings = merge(
    {
      TOKENMILL_HOST                 = "0.0.0.0"
      TOKENMILL_PORT                 = "8000"
      TOKENMILL_HOME                 = local.home
      TOKENMILL_LOG_LEVEL            = var.log_level
      TOKENMILL_KUBERNETES_NAMESPACE = var.namespace
      TOKENMILL_WORKER_IMAGE         = var.worker_image
      TOKENMILL_WORKER_SECRET        = local.worker_secret
    },
    var.s3_region == null ? {} : { TOKENMILL_S3_REGION = var.s3_region },
    var.settings,
  )

  app_secret_data = merge(
    {
      TOKENMILL_INTERNAL_TOKEN = var.internal_token
      TOKENMILL_SECRET_KEY     = var.secret_key
      DATABASE_URL             = var.database_url
      REDIS_URL                = var.redis_url
      TOKENMILL_STORAGE_URL    = var.storage_url
    },
    var.stripe_api_key == null ? {} : { TOKENMILL_STRIPE_API_KEY = var.stripe_api_key },
    var.stripe_webhook_secret == null ? {} : { TOKENMILL_STRIPE_WEBHOOK_SECRET = var.stripe_webhook_secret },
  )

  # Everything a worker gets besides the contract's own variables (envFrom this Secret).
  worker_secret_data = merge(
    {
      TOKENMILL_INTERNAL_TOKEN = var.internal_token
      REDIS_URL                = var.redis_url
      TOKENMILL_STORAGE_URL    = var.storage_url
      TOKENMILL_LOG_LEVEL      = var.log_level
    },
    var.s3_region == null ? {} : { TOKENMILL_S3_REGION = var.s3_region },
  )

  # Pods restart when their settings or secrets change.
  config_checksum = nonsensitive(sha256(jsonencode([local.settings, local.app_secret_data])))

  # A new image runs its migrations under a new Job name, before any Deployment rolls.
  migrate_job = "tokenmill-migrate-${substr(sha256(var.image), 0, 10)}"

  system_nodes = { "tokenmill.dev/pool" = "system" }
}

resource "kubernetes_namespace_v1" "this" {
  metadata {
    name = var.namespace
    labels = merge(local.common_labels, {
      # Every pod here, the workers included, meets the restricted Pod Security Standard.
      "pod-security.kubernetes.io/enforce" = "restricted"
      "pod-security.kubernetes.io/audit"   = "restricted"
      "pod-security.kubernetes.io/warn"    = "restricted"
    })
  }
}

# --- settings and secrets -------------------------------------------------------------

resource "kubernetes_config_map_v1" "settings" {
  metadata {
    name      = local.settings_name
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = local.common_labels
  }

  data = local.settings
}

resource "kubernetes_secret_v1" "app" {
  metadata {
    name      = local.app_secret
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = local.common_labels
  }

  type = "Opaque"
  data = local.app_secret_data
}

resource "kubernetes_secret_v1" "worker" {
  metadata {
    name      = local.worker_secret
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, { "app.kubernetes.io/component" = "worker" })
  }

  type = "Opaque"
  data = local.worker_secret_data
}

# --- service accounts and RBAC ----------------------------------------------------------

resource "kubernetes_service_account_v1" "this" {
  for_each = local.service_accounts

  metadata {
    name        = each.value
    namespace   = kubernetes_namespace_v1.this.metadata[0].name
    labels      = local.common_labels
    annotations = local.role_arns[each.key] == null ? {} : { "eks.amazonaws.com/role-arn" = local.role_arns[each.key] }
  }

  # Only the autoscaler talks to the Kubernetes API; its pods mount the token themselves.
  automount_service_account_token = false
}

# What autoscaler/kubernetes.py does: read, create, replace, scale and delete the worker
# Deployments, mark pods as preferred victims and delete a dead worker's pod. In its
# namespace only.
resource "kubernetes_role_v1" "autoscaler" {
  metadata {
    name      = "tokenmill-autoscaler"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = local.common_labels
  }

  rule {
    api_groups = ["apps"]
    resources  = ["deployments", "deployments/scale"]
    verbs      = ["get", "list", "create", "update", "patch", "delete"]
  }

  rule {
    api_groups = [""]
    resources  = ["pods"]
    verbs      = ["patch", "delete"]
  }
}

resource "kubernetes_role_binding_v1" "autoscaler" {
  metadata {
    name      = "tokenmill-autoscaler"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = local.common_labels
  }

  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "Role"
    name      = kubernetes_role_v1.autoscaler.metadata[0].name
  }

  subject {
    kind      = "ServiceAccount"
    name      = kubernetes_service_account_v1.this["autoscaler"].metadata[0].name
    namespace = kubernetes_namespace_v1.this.metadata[0].name
  }
}

# --- migrations: a Job per image, before the rollout ----------------------------------------

resource "kubernetes_job_v1" "migrate" {
  #checkov:skip=CKV_K8S_8:A Job runs to completion; a liveness probe would only kill a long migration.
  #checkov:skip=CKV_K8S_9:A Job serves no traffic, so there is nothing to be ready for.
  #checkov:skip=CKV_K8S_35:Tokenmill reads DATABASE_URL from the environment (pydantic-settings); the Secret is not written into the pod spec.
  #checkov:skip=CKV_K8S_14:The image is an input validated to carry a version tag or a digest (never :latest); checkov cannot see its value here.
  #checkov:skip=CKV_K8S_43:Images are inputs pinned by tag or digest (validated); the operator's registry keeps tags immutable.
  metadata {
    name      = local.migrate_job
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.migrate)
  }

  spec {
    backoff_limit = 3

    template {
      metadata {
        labels = merge(local.common_labels, local.labels.migrate)
      }

      spec {
        service_account_name            = kubernetes_service_account_v1.this["migrate"].metadata[0].name
        automount_service_account_token = false
        restart_policy                  = "Never"
        node_selector                   = local.system_nodes

        security_context {
          run_as_non_root = true
          run_as_user     = 10001
          run_as_group    = 10001
          fs_group        = 10001

          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "migrate"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          args              = ["migrate", "upgrade"]

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }

          env_from {
            secret_ref {
              name = kubernetes_secret_v1.app.metadata[0].name
            }
          }

          resources {
            requests = { cpu = var.resources.migrate.cpu, memory = var.resources.migrate.memory }
            limits   = { cpu = var.resources.migrate.cpu_limit, memory = var.resources.migrate.memory }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            privileged                 = false

            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "state"
            mount_path = local.home
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "state"
          empty_dir {}
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
      }
    }
  }

  wait_for_completion = true

  timeouts {
    create = var.migration_timeout
    update = var.migration_timeout
  }
}

# --- gateway ----------------------------------------------------------------------------

resource "kubernetes_deployment_v1" "gateway" {
  #checkov:skip=CKV_K8S_35:Tokenmill reads its settings from the environment (pydantic-settings); the Secret is referenced by envFrom, never written into the pod spec.
  #checkov:skip=CKV_K8S_14:The image is an input validated to carry a version tag or a digest (never :latest); checkov cannot see its value here.
  #checkov:skip=CKV_K8S_43:Images are inputs pinned by tag or digest (validated); the operator's registry keeps tags immutable.
  metadata {
    name      = "tokenmill-gateway"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.gateway)
  }

  spec {
    # The HorizontalPodAutoscaler owns the count; this is the first rollout's.
    replicas = var.gateway_replicas.min

    selector {
      match_labels = { "app.kubernetes.io/name" = local.labels.gateway["app.kubernetes.io/name"] }
    }

    strategy {
      type = "RollingUpdate"

      rolling_update {
        max_surge       = "25%"
        max_unavailable = "0"
      }
    }

    template {
      metadata {
        labels      = merge(local.common_labels, local.labels.gateway)
        annotations = { "tokenmill.dev/config-checksum" = local.config_checksum }
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.this["gateway"].metadata[0].name
        automount_service_account_token  = false
        termination_grace_period_seconds = 120 # in-flight streams finish before the pod goes
        node_selector                    = local.system_nodes

        security_context {
          run_as_non_root = true
          run_as_user     = 10001
          run_as_group    = 10001
          fs_group        = 10001

          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        topology_spread_constraint {
          max_skew           = 1
          topology_key       = "topology.kubernetes.io/zone"
          when_unsatisfiable = "ScheduleAnyway"

          label_selector {
            match_labels = { "app.kubernetes.io/name" = local.labels.gateway["app.kubernetes.io/name"] }
          }
        }

        container {
          name              = "gateway"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          args              = ["gateway"]

          port {
            name           = "http"
            container_port = 8000
            protocol       = "TCP"
          }

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }

          env_from {
            secret_ref {
              name = kubernetes_secret_v1.app.metadata[0].name
            }
          }

          readiness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            period_seconds    = 5
            failure_threshold = 3
          }

          liveness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            initial_delay_seconds = 10
            period_seconds        = 10
            failure_threshold     = 6
          }

          resources {
            requests = { cpu = var.resources.gateway.cpu, memory = var.resources.gateway.memory }
            limits   = { cpu = var.resources.gateway.cpu_limit, memory = var.resources.gateway.memory }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            privileged                 = false

            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "state"
            mount_path = local.home
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "state"
          empty_dir {}
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
      }
    }
  }

  lifecycle {
    ignore_changes = [spec[0].replicas]
  }

  depends_on = [kubernetes_job_v1.migrate]
}

resource "kubernetes_service_v1" "gateway" {
  metadata {
    name      = "tokenmill-gateway"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.gateway)
  }

  spec {
    type     = "ClusterIP"
    selector = { "app.kubernetes.io/name" = local.labels.gateway["app.kubernetes.io/name"] }

    port {
      name        = "http"
      port        = 80
      target_port = "http"
      protocol    = "TCP"
    }
  }
}

resource "kubernetes_horizontal_pod_autoscaler_v2" "gateway" {
  metadata {
    name      = "tokenmill-gateway"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.gateway)
  }

  spec {
    min_replicas = var.gateway_replicas.min
    max_replicas = var.gateway_replicas.max

    scale_target_ref {
      api_version = "apps/v1"
      kind        = "Deployment"
      name        = kubernetes_deployment_v1.gateway.metadata[0].name
    }

    metric {
      type = "Resource"

      resource {
        name = "cpu"

        target {
          type                = "Utilization"
          average_utilization = var.gateway_replicas.target_utilization
        }
      }
    }

    behavior {
      scale_down {
        stabilization_window_seconds = 300
        select_policy                = "Max"

        policy {
          type           = "Percent"
          value          = 50
          period_seconds = 60
        }
      }

      scale_up {
        stabilization_window_seconds = 0
        select_policy                = "Max"

        policy {
          type           = "Percent"
          value          = 100
          period_seconds = 30
        }
      }
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "gateway" {
  metadata {
    name      = "tokenmill-gateway"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.gateway)
  }

  spec {
    max_unavailable = "1"

    selector {
      match_labels = { "app.kubernetes.io/name" = local.labels.gateway["app.kubernetes.io/name"] }
    }
  }
}

# --- control plane ------------------------------------------------------------------------

resource "kubernetes_deployment_v1" "control_plane" {
  #checkov:skip=CKV_K8S_35:Tokenmill reads its settings from the environment (pydantic-settings); the Secret is referenced by envFrom, never written into the pod spec.
  #checkov:skip=CKV_K8S_14:The image is an input validated to carry a version tag or a digest (never :latest); checkov cannot see its value here.
  #checkov:skip=CKV_K8S_43:Images are inputs pinned by tag or digest (validated); the operator's registry keeps tags immutable.
  metadata {
    name      = "tokenmill-control-plane"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.control_plane)
  }

  spec {
    replicas = var.control_plane_replicas

    selector {
      match_labels = { "app.kubernetes.io/name" = local.labels.control_plane["app.kubernetes.io/name"] }
    }

    template {
      metadata {
        labels      = merge(local.common_labels, local.labels.control_plane)
        annotations = { "tokenmill.dev/config-checksum" = local.config_checksum }
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.this["control_plane"].metadata[0].name
        automount_service_account_token  = false
        termination_grace_period_seconds = 60
        node_selector                    = local.system_nodes

        security_context {
          run_as_non_root = true
          run_as_user     = 10001
          run_as_group    = 10001
          fs_group        = 10001

          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        topology_spread_constraint {
          max_skew           = 1
          topology_key       = "topology.kubernetes.io/zone"
          when_unsatisfiable = "ScheduleAnyway"

          label_selector {
            match_labels = { "app.kubernetes.io/name" = local.labels.control_plane["app.kubernetes.io/name"] }
          }
        }

        container {
          name              = "control-plane"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          args              = ["control-plane"]

          port {
            name           = "http"
            container_port = 8000
            protocol       = "TCP"
          }

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }

          env_from {
            secret_ref {
              name = kubernetes_secret_v1.app.metadata[0].name
            }
          }

          readiness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            period_seconds    = 5
            failure_threshold = 3
          }

          liveness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            initial_delay_seconds = 10
            period_seconds        = 10
            failure_threshold     = 6
          }

          resources {
            requests = { cpu = var.resources.control_plane.cpu, memory = var.resources.control_plane.memory }
            limits   = { cpu = var.resources.control_plane.cpu_limit, memory = var.resources.control_plane.memory }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            privileged                 = false

            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "state"
            mount_path = local.home
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "state"
          empty_dir {}
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate]
}

resource "kubernetes_service_v1" "control_plane" {
  metadata {
    name      = "tokenmill-control-plane"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.control_plane)
  }

  spec {
    type     = "ClusterIP"
    selector = { "app.kubernetes.io/name" = local.labels.control_plane["app.kubernetes.io/name"] }

    port {
      name        = "http"
      port        = 80
      target_port = "http"
      protocol    = "TCP"
    }
  }
}

resource "kubernetes_pod_disruption_budget_v1" "control_plane" {
  metadata {
    name      = "tokenmill-control-plane"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.control_plane)
  }

  spec {
    max_unavailable = "1"

    selector {
      match_labels = { "app.kubernetes.io/name" = local.labels.control_plane["app.kubernetes.io/name"] }
    }
  }
}

# --- Celery worker and beat ---------------------------------------------------------------

resource "kubernetes_deployment_v1" "celery_worker" {
  #checkov:skip=CKV_K8S_9:The Celery worker serves no traffic and sits behind no Service, so readiness gates nothing; liveness pings it through the broker.
  #checkov:skip=CKV_K8S_35:Tokenmill reads its settings from the environment (pydantic-settings); the Secret is referenced by envFrom, never written into the pod spec.
  #checkov:skip=CKV_K8S_14:The image is an input validated to carry a version tag or a digest (never :latest); checkov cannot see its value here.
  #checkov:skip=CKV_K8S_43:Images are inputs pinned by tag or digest (validated); the operator's registry keeps tags immutable.
  metadata {
    name      = "tokenmill-celery-worker"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.celery_worker)
  }

  spec {
    replicas = var.celery_worker_replicas

    selector {
      match_labels = { "app.kubernetes.io/name" = local.labels.celery_worker["app.kubernetes.io/name"] }
    }

    template {
      metadata {
        labels      = merge(local.common_labels, local.labels.celery_worker)
        annotations = { "tokenmill.dev/config-checksum" = local.config_checksum }
      }

      spec {
        service_account_name             = kubernetes_service_account_v1.this["billing"].metadata[0].name
        automount_service_account_token  = false
        termination_grace_period_seconds = 300 # a running job finishes (it is acked late and retried otherwise)
        node_selector                    = local.system_nodes

        security_context {
          run_as_non_root = true
          run_as_user     = 10001
          run_as_group    = 10001
          fs_group        = 10001

          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "celery-worker"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          args              = ["celery", "worker", "--concurrency", tostring(var.celery_concurrency)]

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }

          env_from {
            secret_ref {
              name = kubernetes_secret_v1.app.metadata[0].name
            }
          }

          liveness_probe {
            exec {
              command = ["sh", "-c", "exec celery -A billing.celery_app inspect ping --timeout 10 -d \"celery@$HOSTNAME\""]
            }
            initial_delay_seconds = 60
            period_seconds        = 120
            timeout_seconds       = 30
            failure_threshold     = 3
          }

          resources {
            requests = { cpu = var.resources.celery_worker.cpu, memory = var.resources.celery_worker.memory }
            limits   = { cpu = var.resources.celery_worker.cpu_limit, memory = var.resources.celery_worker.memory }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            privileged                 = false

            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "state"
            mount_path = local.home
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "state"
          empty_dir {}
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate]
}

resource "kubernetes_deployment_v1" "celery_beat" {
  #checkov:skip=CKV_K8S_8:Celery beat has no endpoint to probe and exits when it loses the broker; the kubelet restarts it.
  #checkov:skip=CKV_K8S_9:Celery beat serves no traffic and sits behind no Service, so readiness gates nothing.
  #checkov:skip=CKV_K8S_35:Tokenmill reads its settings from the environment (pydantic-settings); the Secret is referenced by envFrom, never written into the pod spec.
  #checkov:skip=CKV_K8S_14:The image is an input validated to carry a version tag or a digest (never :latest); checkov cannot see its value here.
  #checkov:skip=CKV_K8S_43:Images are inputs pinned by tag or digest (validated); the operator's registry keeps tags immutable.
  metadata {
    name      = "tokenmill-celery-beat"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.celery_beat)
  }

  spec {
    replicas = 1 # exactly one: two would send every job twice

    selector {
      match_labels = { "app.kubernetes.io/name" = local.labels.celery_beat["app.kubernetes.io/name"] }
    }

    strategy {
      type = "Recreate"
    }

    template {
      metadata {
        labels      = merge(local.common_labels, local.labels.celery_beat)
        annotations = { "tokenmill.dev/config-checksum" = local.config_checksum }
      }

      spec {
        service_account_name            = kubernetes_service_account_v1.this["billing"].metadata[0].name
        automount_service_account_token = false
        node_selector                   = local.system_nodes

        security_context {
          run_as_non_root = true
          run_as_user     = 10001
          run_as_group    = 10001
          fs_group        = 10001

          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "celery-beat"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          args              = ["celery", "beat"]

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }

          env_from {
            secret_ref {
              name = kubernetes_secret_v1.app.metadata[0].name
            }
          }

          resources {
            requests = { cpu = var.resources.celery_beat.cpu, memory = var.resources.celery_beat.memory }
            limits   = { cpu = var.resources.celery_beat.cpu_limit, memory = var.resources.celery_beat.memory }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            privileged                 = false

            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "state"
            mount_path = local.home
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "state"
          empty_dir {}
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate]
}

# --- worker autoscaler ------------------------------------------------------------------------

resource "kubernetes_deployment_v1" "autoscaler" {
  #checkov:skip=CKV_K8S_38:The autoscaler manages the worker Deployments through the Kubernetes API (kubernetes_role_v1.autoscaler), so it needs its service account token.
  #checkov:skip=CKV_K8S_35:Tokenmill reads its settings from the environment (pydantic-settings); the Secret is referenced by envFrom, never written into the pod spec.
  #checkov:skip=CKV_K8S_14:The image is an input validated to carry a version tag or a digest (never :latest); checkov cannot see its value here.
  #checkov:skip=CKV_K8S_43:Images are inputs pinned by tag or digest (validated); the operator's registry keeps tags immutable.
  metadata {
    name      = "tokenmill-autoscaler"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, local.labels.autoscaler)
  }

  spec {
    replicas = var.autoscaler_replicas

    selector {
      match_labels = { "app.kubernetes.io/name" = local.labels.autoscaler["app.kubernetes.io/name"] }
    }

    template {
      metadata {
        labels      = merge(local.common_labels, local.labels.autoscaler)
        annotations = { "tokenmill.dev/config-checksum" = local.config_checksum }
      }

      spec {
        service_account_name            = kubernetes_service_account_v1.this["autoscaler"].metadata[0].name
        automount_service_account_token = true
        node_selector                   = local.system_nodes

        security_context {
          run_as_non_root = true
          run_as_user     = 10001
          run_as_group    = 10001
          fs_group        = 10001

          seccomp_profile {
            type = "RuntimeDefault"
          }
        }

        container {
          name              = "autoscaler"
          image             = var.image
          image_pull_policy = var.image_pull_policy
          args              = ["autoscaler"]

          port {
            name           = "http"
            container_port = 8000
            protocol       = "TCP"
          }

          env {
            name  = "TOKENMILL_AUTOSCALER"
            value = "kubernetes"
          }

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }

          env_from {
            secret_ref {
              name = kubernetes_secret_v1.app.metadata[0].name
            }
          }

          readiness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            period_seconds    = 10
            failure_threshold = 3
          }

          liveness_probe {
            http_get {
              path = "/health"
              port = "http"
            }
            initial_delay_seconds = 10
            period_seconds        = 10
            failure_threshold     = 6
          }

          resources {
            requests = { cpu = var.resources.autoscaler.cpu, memory = var.resources.autoscaler.memory }
            limits   = { cpu = var.resources.autoscaler.cpu_limit, memory = var.resources.autoscaler.memory }
          }

          security_context {
            allow_privilege_escalation = false
            read_only_root_filesystem  = true
            privileged                 = false

            capabilities {
              drop = ["ALL"]
            }
          }

          volume_mount {
            name       = "state"
            mount_path = local.home
          }

          volume_mount {
            name       = "tmp"
            mount_path = "/tmp"
          }
        }

        volume {
          name = "state"
          empty_dir {}
        }

        volume {
          name = "tmp"
          empty_dir {}
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate, kubernetes_role_binding_v1.autoscaler]
}

# --- workers ------------------------------------------------------------------------------------

# The Deployment autoscaler/kubernetes.py creates for a model deployment, per GPU type and for
# CPU workers, built by the same rules (modules/worker-manifest). To run workers by hand
# (autoscaler_replicas = 0), take one, set the deployment id, name and model, and apply it.
module "worker_template" {
  source   = "./modules/worker-manifest"
  for_each = toset(concat(["cpu"], var.worker_gpu_types))

  deployment_id = "DEPLOYMENT-ID"
  name          = "template-${each.key}"
  model         = var.worker_template_model
  gpu_type      = each.key == "cpu" ? null : each.key
  replicas      = 1
  namespace     = var.namespace
  image         = var.worker_image
  secret        = local.worker_secret
}

resource "kubernetes_config_map_v1" "worker_templates" {
  metadata {
    name      = "tokenmill-worker-templates"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, { "app.kubernetes.io/component" = "worker" })
  }

  data = { for kind, template in module.worker_template : "${kind}.json" => jsonencode(template.manifest) }
}

resource "kubernetes_network_policy_v1" "workers" {
  count = var.network_policies ? 1 : 0

  metadata {
    name      = "tokenmill-worker-ingress"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = local.common_labels
  }

  spec {
    pod_selector {
      match_labels = { "app.kubernetes.io/name" = "tokenmill-worker" }
    }

    policy_types = ["Ingress"]

    # Gateways stream /generate; the control plane and autoscaler may ask a worker directly.
    ingress {
      from {
        pod_selector {
          match_expressions {
            key      = "app.kubernetes.io/name"
            operator = "In"
            values = [
              local.labels.gateway["app.kubernetes.io/name"],
              local.labels.control_plane["app.kubernetes.io/name"],
              local.labels.autoscaler["app.kubernetes.io/name"],
            ]
          }
        }
      }

      dynamic "from" {
        for_each = var.monitoring_namespace == null ? [] : [var.monitoring_namespace]

        content {
          namespace_selector {
            match_labels = { "kubernetes.io/metadata.name" = from.value }
          }
        }
      }

      ports {
        port     = "8080"
        protocol = "TCP"
      }
    }
  }
}

# --- ingress ----------------------------------------------------------------------------------

resource "kubernetes_ingress_v1" "api" {
  count = var.api_host == null ? 0 : 1

  metadata {
    name        = "tokenmill-api"
    namespace   = kubernetes_namespace_v1.this.metadata[0].name
    labels      = local.common_labels
    annotations = var.api_ingress_annotations
  }

  spec {
    ingress_class_name = var.ingress_class_name

    dynamic "tls" {
      for_each = var.tls_secret_name == null ? [] : [var.tls_secret_name]

      content {
        hosts       = [var.api_host]
        secret_name = tls.value
      }
    }

    rule {
      host = var.api_host

      http {
        # Only the OpenAI-compatible API and Stripe's webhook are public; /metrics is not.
        path {
          path      = "/v1"
          path_type = "Prefix"

          backend {
            service {
              name = kubernetes_service_v1.gateway.metadata[0].name
              port {
                name = "http"
              }
            }
          }
        }

        path {
          path      = "/webhooks/stripe"
          path_type = "Exact"

          backend {
            service {
              name = kubernetes_service_v1.control_plane.metadata[0].name
              port {
                name = "http"
              }
            }
          }
        }
      }
    }
  }
}

resource "kubernetes_ingress_v1" "admin" {
  count = var.admin_host == null ? 0 : 1

  metadata {
    name        = "tokenmill-admin"
    namespace   = kubernetes_namespace_v1.this.metadata[0].name
    labels      = local.common_labels
    annotations = var.admin_ingress_annotations
  }

  spec {
    ingress_class_name = var.ingress_class_name

    dynamic "tls" {
      for_each = var.tls_secret_name == null ? [] : [var.tls_secret_name]

      content {
        hosts       = [var.admin_host]
        secret_name = tls.value
      }
    }

    rule {
      host = var.admin_host

      http {
        path {
          path      = "/"
          path_type = "Prefix"

          backend {
            service {
              name = kubernetes_service_v1.control_plane.metadata[0].name
              port {
                name = "http"
              }
            }
          }
        }
      }
    }
  }
}
