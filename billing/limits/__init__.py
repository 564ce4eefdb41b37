"""An organisation's limits and budget against what it uses (the dashboard's Limits page and
`GET /admin/v1/organizations/{org}/limits`)."""
