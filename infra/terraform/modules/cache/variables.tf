variable "name" {
  description = "Id of the replication group (and prefix of its other resources)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,38}[a-z0-9]$", var.name))
    error_message = "name must be 3-40 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "vpc_id" {
  description = "VPC of the cache's security group."
  type        = string
}

variable "subnet_ids" {
  description = "Private subnets of the cache nodes."
  type        = list(string)

  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "Give subnets in at least two availability zones."
  }
}

variable "allowed_security_group_ids" {
  description = "Security groups allowed to connect on the Redis port (the cluster's nodes)."
  type        = list(string)
}

variable "engine_version" {
  description = "Redis engine version."
  type        = string
  default     = "7.1"

  validation {
    condition     = can(regex("^7\\.[0-9]+$", var.engine_version))
    error_message = "engine_version must be Redis 7.x (Streams, Lua and TLS as Tokenmill uses them)."
  }
}

variable "node_type" {
  description = "ElastiCache node type."
  type        = string
  default     = "cache.r7g.large"

  validation {
    condition     = startswith(var.node_type, "cache.")
    error_message = "node_type must be an ElastiCache node type such as cache.r7g.large."
  }
}

variable "num_cache_clusters" {
  description = "Nodes in the replication group: one primary and replicas in other zones; 2 or more turns on automatic failover."
  type        = number
  default     = 2

  validation {
    condition     = var.num_cache_clusters >= 1 && var.num_cache_clusters <= 6
    error_message = "num_cache_clusters must be between 1 and 6."
  }
}

variable "users" {
  description = <<-EOT
    Redis users (ElastiCache RBAC), by name: each component connects as its own user with its own
    password (generated, kept in Secrets Manager as JSON {username, password}), so a worker's
    credentials open only what a worker does. access_string is Redis ACL syntax. The built-in
    default user is switched off.
  EOT
  type = map(object({
    access_string = string
  }))
  default = {
    # Rate limits, budgets, the bus (tm:* keys), usage events, Lua scripts.
    gateway       = { access_string = "on ~tm:* &* +@all -@dangerous" }
    control-plane = { access_string = "on ~tm:* &* +@all -@dangerous" }
    autoscaler    = { access_string = "on ~tm:* &* +@all -@dangerous" }
    # Celery's broker and results (its own keys) and the billing jobs' tm:* keys.
    billing = { access_string = "on ~* &* +@all -@dangerous" }
    # A worker only appends heartbeats and KV events to two streams: no reads, no usage, no limits.
    worker = { access_string = "on ~tm:workers ~tm:kv -@all +xadd +ping +hello +client|setinfo +client|setname" }
  }

  validation {
    condition     = alltrue([for name in keys(var.users) : can(regex("^[a-z][a-z0-9-]{0,20}$", name)) && name != "default"])
    error_message = "users are named with lower-case letters, digits and '-' (at most 21), not default."
  }

  validation {
    condition     = alltrue([for u in values(var.users) : startswith(u.access_string, "on ")])
    error_message = "Every user's access_string starts with \"on \" (the default user is the only one switched off)."
  }
}

variable "snapshot_retention_days" {
  description = "Days daily snapshots are kept (the rate-limit and bus state is rebuilt anyway; PostgreSQL is the truth)."
  type        = number
  default     = 7

  validation {
    condition     = var.snapshot_retention_days >= 1 && var.snapshot_retention_days <= 35
    error_message = "snapshot_retention_days must be between 1 and 35."
  }
}

variable "maintenance_window" {
  description = "Weekly UTC maintenance window (ddd:hh24:mi-ddd:hh24:mi)."
  type        = string
  default     = "sun:05:00-sun:06:00"
}

variable "log_retention_days" {
  description = "Days the slow and engine logs are kept in CloudWatch Logs."
  type        = number
  default     = 365

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.log_retention_days)
    error_message = "log_retention_days must be a retention CloudWatch Logs supports (e.g. 30, 90, 365)."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
