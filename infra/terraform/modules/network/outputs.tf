output "vpc_id" {
  description = "Id of the VPC."
  value       = aws_vpc.this.id
}

output "vpc_cidr" {
  description = "CIDR block of the VPC."
  value       = aws_vpc.this.cidr_block
}

output "private_subnet_ids" {
  description = "Private subnets (nodes, database, cache), one per availability zone."
  value       = aws_subnet.private[*].id
}

output "public_subnet_ids" {
  description = "Public subnets (NAT gateways, internet-facing load balancers), one per availability zone."
  value       = aws_subnet.public[*].id
}

output "nat_public_ips" {
  description = "Addresses the cluster's outbound traffic leaves from (for allow-lists elsewhere)."
  value       = aws_eip.nat[*].public_ip
}
