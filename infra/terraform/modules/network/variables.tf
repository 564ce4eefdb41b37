variable "name" {
  description = "Name prefix of every resource (and the EKS cluster name the subnets are tagged for)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}[a-z0-9]$", var.name))
    error_message = "name must be 3-32 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "cidr" {
  description = "CIDR block of the VPC; private subnets get a /(prefix+4) each, public ones a /(prefix+8)."
  type        = string
  default     = "10.40.0.0/16"

  validation {
    condition     = can(cidrhost(var.cidr, 0)) && tonumber(split("/", var.cidr)[1]) >= 16 && tonumber(split("/", var.cidr)[1]) <= 20
    error_message = "cidr must be an IPv4 CIDR block between /16 and /20."
  }
}

variable "azs" {
  description = "Availability zones to spread the subnets over (one private and one public subnet in each)."
  type        = list(string)

  validation {
    condition     = length(var.azs) >= 2 && length(var.azs) <= 6 && length(distinct(var.azs)) == length(var.azs)
    error_message = "Give 2 to 6 distinct availability zones."
  }
}

variable "single_nat_gateway" {
  description = "One NAT gateway for all zones (cheaper) instead of one per zone (survives a zone outage)."
  type        = bool
  default     = false
}

variable "flow_log_retention_days" {
  description = "Days the VPC flow logs are kept in CloudWatch Logs."
  type        = number
  default     = 365

  validation {
    condition     = contains([1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.flow_log_retention_days)
    error_message = "flow_log_retention_days must be a retention CloudWatch Logs supports (e.g. 30, 90, 365)."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
