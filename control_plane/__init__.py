"""Control plane: organisations, users, API keys, the catalogue (models, adapters,
deployments, worker lifetimes), plans and the audit log, one domain package each;
`policy` holds every role, organisation-status and quota rule, `unit` the unit of work."""
