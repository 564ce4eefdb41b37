# Tokenmill on Kubernetes: the namespace, settings, the secrets (External Secrets from Secrets
# Manager: a Secret per component, so each holds only its own credentials), the migration Job
# (which also creates the services' database role), the Deployments of the gateway, control
# plane, Celery worker and beat and the worker autoscaler, their Services, Ingresses, the
# gateway's HorizontalPodAutoscaler, graceful rollouts behind the ALB (modules/rollout), the
# autoscaler's RBAC and an admission policy limiting what it may create, Prometheus monitors
# and alerts, and the worker templates: the Deployment the autoscaler creates for each model
# deployment.

locals {
  home = "/var/lib/tokenmill"

  service_accounts = {
    gateway       = "tokenmill-gateway"
    control_plane = "tokenmill-control-plane"
    billing       = "tokenmill-billing"
    autoscaler    = "tokenmill-autoscaler"
    migrate       = "tokenmill-migrate"
    worker        = "tokenmill-worker"  # fixed by the manifest contract (autoscaler/kubernetes.py)
    secrets       = "tokenmill-secrets" # External Secrets reads Secrets Manager as this one (IRSA)
  }
  role_arns = {
    gateway       = var.files_writer_role_arn
    control_plane = var.writer_role_arn
    billing       = var.writer_role_arn
    autoscaler    = null
    migrate       = null
    worker        = var.reader_role_arn
    secrets       = var.secret_store.role_arn
  }

  worker_secret = "tokenmill-worker" # TOKENMILL_WORKER_SECRET's default
  settings_name = "tokenmill"
  store         = "aws-secrets-manager"
  stripe_secret = "tokenmill-stripe" # optional in every pod: empty until the operator puts keys

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
      TOKENMILL_HOST                   = "0.0.0.0"
      TOKENMILL_PORT                   = "8000"
      TOKENMILL_HOME                   = local.home
      TOKENMILL_LOG_LEVEL              = var.log_level
      TOKENMILL_KUBERNETES_NAMESPACE   = var.namespace
      TOKENMILL_WORKER_IMAGE           = var.worker_image
      TOKENMILL_WORKER_SECRET          = local.worker_secret
      TOKENMILL_STORAGE_URL            = var.storage_url
      TOKENMILL_MAX_STREAM_SECONDS     = tostring(module.rollout.max_stream_seconds)
      TOKENMILL_SHUTDOWN_GRACE_SECONDS = tostring(module.rollout.graceful_shutdown_seconds)
      TOKENMILL_WORKER_RESOURCES       = jsonencode(var.worker_resources)
      TOKENMILL_VLLM_IMAGE             = var.vllm_image
    },
    var.s3_region == null ? {} : { TOKENMILL_S3_REGION = var.s3_region },
    var.settings,
  )

  # --- secrets: one Secret per component, rendered by External Secrets from Secrets Manager ---
  # DATABASE_URL verifies the server's certificate (the RDS CA bundle is in the images:
  # PGSSLROOTCERT); Redis URLs name each component's own user (TLS, certificate verified).
  database_url = "postgresql+asyncpg://{{ .db_username }}:{{ .db_password | urlquery }}@${var.database.address}:${var.database.port}/${var.database.name}?ssl=verify-full"
  owner_url    = "postgresql+asyncpg://{{ .owner_username }}:{{ .owner_password | urlquery }}@${var.database.address}:${var.database.port}/${var.database.name}?ssl=verify-full"
  redis_url    = "rediss://{{ .redis_username }}:{{ .redis_password | urlquery }}@${var.redis.endpoint}:${var.redis.port}/0?ssl_cert_reqs=required"

  # Secrets Manager entries each Secret reads: secret key -> [secret name, JSON property or null].
  remote = {
    app_db    = { db_username = [var.secrets.database_app, "username"], db_password = [var.secrets.database_app, "password"] }
    owner_db  = { owner_username = [var.database.owner_secret, "username"], owner_password = [var.database.owner_secret, "password"] }
    internal  = { internal_token = [var.secrets.internal_token, null] }
    worker    = { worker_token = [var.secrets.worker_token, null] }
    key       = { secret_key = [var.secrets.secret_key, null] }
    redis_for = { for user, secret in var.redis.user_secrets : user => { redis_username = [secret, "username"], redis_password = [secret, "password"] } }
  }

  # What each component's Secret holds (keys: environment variables; values: ESO templates).
  component_secrets = {
    tokenmill-gateway = {
      remote = merge(local.remote.app_db, local.remote.internal, local.remote.worker, local.remote.key, local.remote.redis_for["gateway"])
      data = {
        DATABASE_URL             = local.database_url
        REDIS_URL                = local.redis_url
        TOKENMILL_INTERNAL_TOKEN = "{{ .internal_token }}"
        TOKENMILL_WORKER_TOKEN   = "{{ .worker_token }}"
        TOKENMILL_SECRET_KEY     = "{{ .secret_key }}"
      }
    }
    tokenmill-control-plane = {
      remote = merge(local.remote.app_db, local.remote.internal, local.remote.worker, local.remote.key, local.remote.redis_for["control-plane"])
      data = {
        DATABASE_URL             = local.database_url
        REDIS_URL                = local.redis_url
        TOKENMILL_INTERNAL_TOKEN = "{{ .internal_token }}"
        TOKENMILL_WORKER_TOKEN   = "{{ .worker_token }}"
        TOKENMILL_SECRET_KEY     = "{{ .secret_key }}"
      }
    }
    tokenmill-billing = {
      remote = merge(local.remote.app_db, local.remote.internal, local.remote.key, local.remote.redis_for["billing"])
      data = {
        DATABASE_URL             = local.database_url
        REDIS_URL                = local.redis_url
        TOKENMILL_INTERNAL_TOKEN = "{{ .internal_token }}"
        TOKENMILL_SECRET_KEY     = "{{ .secret_key }}"
      }
    }
    # The workers' token too: what Prometheus scrapes its /metrics with (as every service's).
    tokenmill-autoscaler = {
      remote = merge(local.remote.app_db, local.remote.internal, local.remote.worker, local.remote.key, local.remote.redis_for["autoscaler"])
      data = {
        DATABASE_URL             = local.database_url
        REDIS_URL                = local.redis_url
        TOKENMILL_INTERNAL_TOKEN = "{{ .internal_token }}"
        TOKENMILL_WORKER_TOKEN   = "{{ .worker_token }}"
        TOKENMILL_SECRET_KEY     = "{{ .secret_key }}"
      }
    }
    # The migrations run as the database's owner (RDS's master user); they create the services'
    # role from TOKENMILL_APP_DATABASE_URL. Only this Job gets the owner's credentials.
    tokenmill-migrate = {
      remote = merge(local.remote.owner_db, local.remote.app_db)
      data = {
        DATABASE_URL               = local.owner_url
        TOKENMILL_APP_DATABASE_URL = local.database_url
      }
    }
    # Workers (the contract: envFrom this Secret only): their own token, which cannot publish
    # usage, and their own Redis user, which may only append heartbeats and KV events.
    (local.worker_secret) = {
      remote = merge(local.remote.worker, local.remote.redis_for["worker"])
      data = merge(
        {
          REDIS_URL              = local.redis_url
          TOKENMILL_WORKER_TOKEN = "{{ .worker_token }}"
          TOKENMILL_STORAGE_URL  = var.storage_url
          TOKENMILL_LOG_LEVEL    = var.log_level
        },
        var.s3_region == null ? {} : { TOKENMILL_S3_REGION = var.s3_region },
      )
    }
    # Prometheus scrapes every /metrics (workers and services) with the workers' token.
    tokenmill-metrics = {
      remote = local.remote.worker
      data   = { token = "{{ .worker_token }}" }
    }
  }

  secret_store = {
    apiVersion = "external-secrets.io/v1"
    kind       = "SecretStore"
    metadata   = { name = local.store, namespace = var.namespace, labels = local.common_labels }
    spec = {
      provider = {
        aws = {
          service = "SecretsManager"
          region  = var.secret_store.region
          auth    = { jwt = { serviceAccountRef = { name = local.service_accounts.secrets } } }
        }
      }
    }
  }

  external_secrets = concat(
    [
      for name, secret in local.component_secrets : {
        apiVersion = "external-secrets.io/v1"
        kind       = "ExternalSecret"
        metadata   = { name = name, namespace = var.namespace, labels = local.common_labels }
        spec = {
          refreshInterval = var.secret_refresh_interval
          secretStoreRef  = { name = local.store, kind = "SecretStore" }
          target = {
            name           = name
            creationPolicy = "Owner"
            template       = { engineVersion = "v2", metadata = { labels = local.common_labels }, data = secret.data }
          }
          data = [
            for key, ref in secret.remote : merge(
              { secretKey = key, remoteRef = { key = ref[0] } },
              ref[1] == null ? {} : { remoteRef = { key = ref[0], property = ref[1] } },
            )
          ]
        }
      }
    ],
    [
      {
        apiVersion = "external-secrets.io/v1"
        kind       = "ExternalSecret"
        metadata   = { name = local.stripe_secret, namespace = var.namespace, labels = local.common_labels }
        spec = {
          refreshInterval = var.secret_refresh_interval
          secretStoreRef  = { name = local.store, kind = "SecretStore" }
          target          = { name = local.stripe_secret, creationPolicy = "Owner" }
          # Every key of the JSON (TOKENMILL_STRIPE_API_KEY, TOKENMILL_STRIPE_WEBHOOK_SECRET).
          dataFrom = [{ extract = { key = var.secrets.stripe } }]
        }
      }
    ],
  )

  # Pods restart when their settings or the shape of their secrets change (a rotated value is
  # picked up by `kubectl rollout restart`, see the README).
  config_checksum = sha256(jsonencode([local.settings, local.component_secrets]))

  # A new image runs its migrations under a new Job name, before any Deployment rolls.
  migrate_job = "tokenmill-migrate-${substr(sha256(var.image), 0, 10)}"

  system_nodes = { "tokenmill.dev/pool" = "system" }

  # TOKENMILL_GATEWAY_URL of the Celery pods: the batch runner (billing.run_batches) sends each
  # line through the gateways' Service, and beat schedules it only when this is set.
  gateway_url = "http://${kubernetes_service_v1.gateway.metadata[0].name}.${kubernetes_namespace_v1.this.metadata[0].name}.svc:${kubernetes_service_v1.gateway.spec[0].port[0].port}"

  # Scratch space of a service container (its state and /tmp volumes): requested and limited.
  scratch = "2Gi"
}

resource "kubernetes_namespace_v1" "this" {
  metadata {
    name = var.namespace
    labels = merge(local.common_labels, {
      # Every pod here, the workers included, meets the restricted Pod Security Standard.
      "pod-security.kubernetes.io/enforce" = "restricted"
      "pod-security.kubernetes.io/audit"   = "restricted"
      "pod-security.kubernetes.io/warn"    = "restricted"
      # The AWS Load Balancer Controller adds a readiness gate to the pods behind an ALB: a new
      # pod counts as ready only once the ALB reports it healthy, so rollouts never run short.
      "elbv2.k8s.aws/pod-readiness-gate-inject" = "enabled"
    })
  }
}

module "rollout" {
  source = "./modules/rollout"

  max_stream_seconds = var.max_stream_seconds
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

# The SecretStore and the ExternalSecrets (CRDs of External Secrets, installed by modules/addons
# in the same apply: hence a Helm release of plain manifests rather than kubernetes_manifest).
resource "helm_release" "secrets" {
  name      = "tokenmill-secrets"
  chart     = "${path.module}/../../charts/manifests"
  namespace = kubernetes_namespace_v1.this.metadata[0].name

  values = [yamlencode({ manifests = concat([local.secret_store], local.external_secrets) })]

  depends_on = [kubernetes_service_account_v1.this]
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
# Deployments and their PodDisruptionBudgets, mark pods as preferred victims and delete a dead
# worker's pod, in its namespace only; and create the workers' PriorityClass (cluster-scoped:
# a ClusterRole). What it may create is narrowed further by the admission policy below.
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

  rule {
    api_groups = ["policy"]
    resources  = ["poddisruptionbudgets"]
    verbs      = ["get", "create", "delete"]
  }
}

resource "kubernetes_cluster_role_v1" "autoscaler" {
  metadata {
    name   = "tokenmill-autoscaler"
    labels = local.common_labels
  }

  # RBAC cannot limit create by name: the admission policy allows only tokenmill-worker.
  rule {
    api_groups = ["scheduling.k8s.io"]
    resources  = ["priorityclasses"]
    verbs      = ["create"]
  }

  rule {
    api_groups     = ["scheduling.k8s.io"]
    resources      = ["priorityclasses"]
    resource_names = ["tokenmill-worker"]
    verbs          = ["get"]
  }
}

resource "kubernetes_cluster_role_binding_v1" "autoscaler" {
  metadata {
    name   = "tokenmill-autoscaler"
    labels = local.common_labels
  }

  role_ref {
    api_group = "rbac.authorization.k8s.io"
    kind      = "ClusterRole"
    name      = kubernetes_cluster_role_v1.autoscaler.metadata[0].name
  }

  subject {
    kind      = "ServiceAccount"
    name      = kubernetes_service_account_v1.this["autoscaler"].metadata[0].name
    namespace = kubernetes_namespace_v1.this.metadata[0].name
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

# What the autoscaler may create, beyond what RBAC can say (RBAC grants verbs on kinds; this
# looks at the objects): only worker Deployments running the worker image as the worker service
# account with the worker Secret, emptyDir volumes and no host access; only their disruption
# budgets; only the workers' PriorityClass; and only worker pods to mark or delete. A stolen
# autoscaler token cannot start a pod with another service account, another Secret or another
# image (vLLM's, pinned by digest, as an init container of a vllm deployment's pod only).
locals {
  autoscaler_user = "system:serviceaccount:${var.namespace}:${local.service_accounts.autoscaler}"
  is              = "request.resource.group == '%s' && request.resource.resource == '%s'"

  autoscaler_policy = {
    apiVersion = "admissionregistration.k8s.io/v1"
    kind       = "ValidatingAdmissionPolicy"
    metadata   = { name = "tokenmill-autoscaler", labels = local.common_labels }
    spec = {
      failurePolicy = "Fail"
      matchConstraints = {
        resourceRules = [
          { apiGroups = ["apps"], apiVersions = ["v1"], operations = ["CREATE", "UPDATE"], resources = ["deployments"] },
          { apiGroups = ["policy"], apiVersions = ["v1"], operations = ["CREATE", "UPDATE"], resources = ["poddisruptionbudgets"] },
          { apiGroups = ["scheduling.k8s.io"], apiVersions = ["v1"], operations = ["CREATE", "UPDATE"], resources = ["priorityclasses"] },
          { apiGroups = [""], apiVersions = ["v1"], operations = ["UPDATE", "DELETE"], resources = ["pods"] },
        ]
      }
      matchConditions = [{ name = "the-autoscaler", expression = "request.userInfo.username == '${local.autoscaler_user}'" }]
      validations = [
        {
          expression = "!(${format(local.is, "apps", "deployments")}) || (object.metadata.name.startsWith('tm-worker-') && has(object.metadata.labels) && object.metadata.labels.exists(k, k == 'app.kubernetes.io/managed-by' && object.metadata.labels[k] == 'tokenmill-autoscaler'))"
          message    = "the autoscaler creates worker Deployments only (tm-worker-*, managed by tokenmill-autoscaler)"
        },
        {
          expression = "!(${format(local.is, "apps", "deployments")}) || (object.spec.template.spec.serviceAccountName == '${local.service_accounts.worker}' && object.spec.template.spec.automountServiceAccountToken == false && object.spec.template.spec.priorityClassName == 'tokenmill-worker')"
          message    = "worker pods run as the tokenmill-worker service account, without its API token, at the workers' priority"
        },
        {
          expression = "!(${format(local.is, "apps", "deployments")}) || (!has(object.spec.template.spec.ephemeralContainers) && object.spec.template.spec.containers.all(c, c.image == '${var.worker_image}') && (!has(object.spec.template.spec.initContainers) || object.spec.template.spec.initContainers.all(c, c.image == '${var.worker_image}' || c.image == '${var.vllm_image}')))"
          message    = "worker pods run the worker image (TOKENMILL_WORKER_IMAGE), and beside it vLLM's (TOKENMILL_VLLM_IMAGE) only"
        },
        {
          expression = "!(${format(local.is, "apps", "deployments")}) || ((!has(object.spec.template.spec.initContainers) ? [] : object.spec.template.spec.initContainers) + object.spec.template.spec.containers).all(c, (!has(c.envFrom) || c.envFrom.all(e, has(e.secretRef) && e.secretRef.name == '${local.worker_secret}')) && (!has(c.env) || c.env.all(e, !has(e.valueFrom) || !has(e.valueFrom.secretKeyRef))))"
          message    = "worker pods read the worker Secret and no other"
        },
        {
          expression = "!(${format(local.is, "apps", "deployments")}) || ((!has(object.spec.template.spec.volumes) || object.spec.template.spec.volumes.all(v, has(v.emptyDir))) && !(has(object.spec.template.spec.hostNetwork) && object.spec.template.spec.hostNetwork) && !(has(object.spec.template.spec.hostPID) && object.spec.template.spec.hostPID) && !(has(object.spec.template.spec.hostIPC) && object.spec.template.spec.hostIPC))"
          message    = "worker pods use emptyDir volumes only and nothing of the host"
        },
        {
          expression = "!(${format(local.is, "policy", "poddisruptionbudgets")}) || (object.metadata.name.startsWith('tm-worker-') && object.spec.selector.matchLabels['app.kubernetes.io/name'] == 'tokenmill-worker')"
          message    = "the autoscaler creates disruption budgets of workers only"
        },
        {
          expression = "!(${format(local.is, "scheduling.k8s.io", "priorityclasses")}) || (object.metadata.name == 'tokenmill-worker' && object.value <= 1000000 && !(has(object.globalDefault) && object.globalDefault) && has(object.preemptionPolicy) && object.preemptionPolicy == 'Never')"
          message    = "the autoscaler creates the tokenmill-worker PriorityClass only: not the default, never preempting, below the system's classes"
        },
        {
          expression = "!(${format(local.is, "", "pods")}) || (has(oldObject.metadata.labels) && oldObject.metadata.labels.exists(k, k == 'app.kubernetes.io/name' && oldObject.metadata.labels[k] == 'tokenmill-worker') && (request.operation == 'DELETE' || object.spec == oldObject.spec))"
          message    = "the autoscaler marks (annotations only) or deletes worker pods only"
        },
      ]
    }
  }

  autoscaler_policy_binding = {
    apiVersion = "admissionregistration.k8s.io/v1"
    kind       = "ValidatingAdmissionPolicyBinding"
    metadata   = { name = "tokenmill-autoscaler", labels = local.common_labels }
    spec       = { policyName = "tokenmill-autoscaler", validationActions = ["Deny"] }
  }
}

resource "helm_release" "policies" {
  name      = "tokenmill-policies"
  chart     = "${path.module}/../../charts/manifests"
  namespace = kubernetes_namespace_v1.this.metadata[0].name

  values = [yamlencode({ manifests = [local.autoscaler_policy, local.autoscaler_policy_binding] })]
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
              name = "tokenmill-migrate" # External Secrets renders it (local.component_secrets)
            }
          }

          resources {
            requests = { cpu = var.resources.migrate.cpu, memory = var.resources.migrate.memory, "ephemeral-storage" = local.scratch }
            limits   = { cpu = var.resources.migrate.cpu_limit, memory = var.resources.migrate.memory, "ephemeral-storage" = local.scratch }
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
          empty_dir {
            size_limit = local.scratch
          }
        }

        volume {
          name = "tmp"
          empty_dir {
            size_limit = local.scratch
          }
        }
      }
    }
  }

  depends_on = [helm_release.secrets]

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
        service_account_name            = kubernetes_service_account_v1.this["gateway"].metadata[0].name
        automount_service_account_token = false
        # preStop (the ALB drains the target), then uvicorn's graceful shutdown: modules/rollout.
        termination_grace_period_seconds = module.rollout.termination_grace_period_seconds
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
              name = "tokenmill-gateway" # External Secrets renders it (local.component_secrets)
            }
          }

          # Keep serving while the ALB drains this target (it sends nothing new meanwhile), then
          # SIGTERM starts uvicorn's graceful shutdown.
          lifecycle {
            pre_stop {
              exec {
                command = ["sleep", tostring(module.rollout.prestop_seconds)]
              }
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

          # Alive = the process accepts connections; ready = /health answers (and, behind the ALB,
          # the target is healthy: readiness gate). Distinct, so a slow /health never kills a pod.
          liveness_probe {
            tcp_socket {
              port = "http"
            }
            timeout_seconds       = 5
            initial_delay_seconds = 10
            period_seconds        = 10
            failure_threshold     = 6
          }

          resources {
            requests = { cpu = var.resources.gateway.cpu, memory = var.resources.gateway.memory, "ephemeral-storage" = local.scratch }
            limits   = { cpu = var.resources.gateway.cpu_limit, memory = var.resources.gateway.memory, "ephemeral-storage" = local.scratch }
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
          empty_dir {
            size_limit = local.scratch
          }
        }

        volume {
          name = "tmp"
          empty_dir {
            size_limit = local.scratch
          }
        }
      }
    }
  }

  lifecycle {
    ignore_changes = [spec[0].replicas]
  }

  depends_on = [kubernetes_job_v1.migrate, helm_release.secrets]
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
        termination_grace_period_seconds = module.rollout.termination_grace_period_seconds
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
              name = "tokenmill-control-plane" # External Secrets renders it (local.component_secrets)
            }
          }

          env_from {
            secret_ref {
              name     = local.stripe_secret
              optional = true
            }
          }

          # Keep serving while the ALB drains this target (it sends nothing new meanwhile), then
          # SIGTERM starts uvicorn's graceful shutdown.
          lifecycle {
            pre_stop {
              exec {
                command = ["sleep", tostring(module.rollout.prestop_seconds)]
              }
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

          # Alive = the process accepts connections; ready = /health answers (and, behind the ALB,
          # the target is healthy: readiness gate). Distinct, so a slow /health never kills a pod.
          liveness_probe {
            tcp_socket {
              port = "http"
            }
            timeout_seconds       = 5
            initial_delay_seconds = 10
            period_seconds        = 10
            failure_threshold     = 6
          }

          resources {
            requests = { cpu = var.resources.control_plane.cpu, memory = var.resources.control_plane.memory, "ephemeral-storage" = local.scratch }
            limits   = { cpu = var.resources.control_plane.cpu_limit, memory = var.resources.control_plane.memory, "ephemeral-storage" = local.scratch }
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
          empty_dir {
            size_limit = local.scratch
          }
        }

        volume {
          name = "tmp"
          empty_dir {
            size_limit = local.scratch
          }
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate, helm_release.secrets]
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

          env {
            name  = "TOKENMILL_GATEWAY_URL"
            value = local.gateway_url
          }

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }

          env_from {
            secret_ref {
              name = "tokenmill-billing" # External Secrets renders it (local.component_secrets)
            }
          }

          env_from {
            secret_ref {
              name     = local.stripe_secret
              optional = true
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
            requests = { cpu = var.resources.celery_worker.cpu, memory = var.resources.celery_worker.memory, "ephemeral-storage" = local.scratch }
            limits   = { cpu = var.resources.celery_worker.cpu_limit, memory = var.resources.celery_worker.memory, "ephemeral-storage" = local.scratch }
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
          empty_dir {
            size_limit = local.scratch
          }
        }

        volume {
          name = "tmp"
          empty_dir {
            size_limit = local.scratch
          }
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate, helm_release.secrets]
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

          env {
            name  = "TOKENMILL_GATEWAY_URL"
            value = local.gateway_url
          }

          env_from {
            config_map_ref {
              name = kubernetes_config_map_v1.settings.metadata[0].name
            }
          }

          env_from {
            secret_ref {
              name = "tokenmill-billing" # External Secrets renders it (local.component_secrets)
            }
          }

          env_from {
            secret_ref {
              name     = local.stripe_secret
              optional = true
            }
          }

          resources {
            requests = { cpu = var.resources.celery_beat.cpu, memory = var.resources.celery_beat.memory, "ephemeral-storage" = local.scratch }
            limits   = { cpu = var.resources.celery_beat.cpu_limit, memory = var.resources.celery_beat.memory, "ephemeral-storage" = local.scratch }
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
          empty_dir {
            size_limit = local.scratch
          }
        }

        volume {
          name = "tmp"
          empty_dir {
            size_limit = local.scratch
          }
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate, helm_release.secrets]
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
              name = "tokenmill-autoscaler" # External Secrets renders it (local.component_secrets)
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

          # Alive = the process accepts connections; ready = /health answers (and, behind the ALB,
          # the target is healthy: readiness gate). Distinct, so a slow /health never kills a pod.
          liveness_probe {
            tcp_socket {
              port = "http"
            }
            timeout_seconds       = 5
            initial_delay_seconds = 10
            period_seconds        = 10
            failure_threshold     = 6
          }

          resources {
            requests = { cpu = var.resources.autoscaler.cpu, memory = var.resources.autoscaler.memory, "ephemeral-storage" = local.scratch }
            limits   = { cpu = var.resources.autoscaler.cpu_limit, memory = var.resources.autoscaler.memory, "ephemeral-storage" = local.scratch }
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
          empty_dir {
            size_limit = local.scratch
          }
        }

        volume {
          name = "tmp"
          empty_dir {
            size_limit = local.scratch
          }
        }
      }
    }
  }

  depends_on = [kubernetes_job_v1.migrate, helm_release.secrets, kubernetes_role_binding_v1.autoscaler, kubernetes_cluster_role_binding_v1.autoscaler, helm_release.policies]
}

# --- workers ------------------------------------------------------------------------------------

# The Deployment autoscaler/kubernetes.py creates for a model deployment, per GPU type (on the
# builtin engine, and as vllm-<type> with vLLM beside the worker) and for CPU workers, built by
# the same rules (modules/worker-manifest). To run workers by hand (autoscaler_replicas = 0),
# take one, set the deployment id, name and model (and a vLLM one's engine flags), and apply it.
locals {
  worker_templates = merge(
    { cpu = { gpu_type = null, engine = "builtin" } },
    { for t in var.worker_gpu_types : t => { gpu_type = t, engine = "builtin" } },
    { for t in var.worker_gpu_types : "vllm-${t}" => { gpu_type = t, engine = "vllm" } },
  )
}

module "worker_template" {
  source   = "./modules/worker-manifest"
  for_each = local.worker_templates

  deployment_id = "DEPLOYMENT-ID"
  name          = "template-${each.key}"
  model         = var.worker_template_model
  gpu_type      = each.value.gpu_type
  engine        = each.value.engine
  replicas      = 1
  namespace     = var.namespace
  image         = var.worker_image
  secret        = local.worker_secret
  # As the autoscaler sizes and starts them: TOKENMILL_WORKER_RESOURCES,
  # TOKENMILL_MAX_STREAM_SECONDS, TOKENMILL_VLLM_IMAGE, TOKENMILL_BLOCK_SIZE.
  share              = each.value.gpu_type == null ? {} : lookup(var.worker_resources, each.value.gpu_type, {})
  max_stream_seconds = module.rollout.max_stream_seconds
  vllm_image         = var.vllm_image
  block_size         = tonumber(lookup(local.settings, "TOKENMILL_BLOCK_SIZE", "16"))
  # No engine arguments: only the worker's own default (autoscaler/kubernetes.py vllm_server_flags).
  engine_flags = concat(
    ["--scheduling-policy", "priority"],
    contains(["0", "false", "f", "no", "n", "off"], lower(lookup(local.settings, "TOKENMILL_PREFIX_CACHING", "true"))) ? ["--no-enable-prefix-caching"] : [],
  )
}

resource "kubernetes_config_map_v1" "worker_templates" {
  metadata {
    name      = "tokenmill-worker-templates"
    namespace = kubernetes_namespace_v1.this.metadata[0].name
    labels    = merge(local.common_labels, { "app.kubernetes.io/component" = "worker" })
  }

  data = merge(
    { for kind, template in module.worker_template : "${kind}.json" => jsonencode(template.manifest) },
    { for kind, template in module.worker_template : "${kind}-budget.json" => jsonencode(template.disruption_budget) },
  )
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

# --- monitoring -------------------------------------------------------------------------------

module "monitoring" {
  source = "./modules/monitoring"

  namespace      = var.namespace
  services       = [for name in ["gateway", "control_plane", "autoscaler"] : local.labels[name]["app.kubernetes.io/name"]]
  metrics_secret = "tokenmill-metrics"
}

# PodMonitors and alert rules (CRDs of the Prometheus operator, modules/addons).
resource "helm_release" "monitoring" {
  count = var.monitoring ? 1 : 0

  name      = "tokenmill-monitoring"
  chart     = "${path.module}/../../charts/manifests"
  namespace = kubernetes_namespace_v1.this.metadata[0].name

  values = [yamlencode({ manifests = module.monitoring.manifests })]

  depends_on = [helm_release.secrets] # the metrics token
}

# --- ingress ----------------------------------------------------------------------------------

locals {
  # The ALB keeps sending in-flight requests to a draining target this long (the longest
  # stream), and the pods' preStop outlasts it (modules/rollout).
  target_group_attributes = {
    "alb.ingress.kubernetes.io/target-group-attributes" = "deregistration_delay.timeout_seconds=${module.rollout.deregistration_delay_seconds}"
  }
}

resource "kubernetes_ingress_v1" "api" {
  count = var.api_host == null ? 0 : 1

  metadata {
    name        = "tokenmill-api"
    namespace   = kubernetes_namespace_v1.this.metadata[0].name
    labels      = local.common_labels
    annotations = merge(var.api_ingress_annotations, local.target_group_attributes)
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
    annotations = merge(var.admin_ingress_annotations, local.target_group_attributes)
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
