-- The PostgreSQL role of Grafana's data source for tokenmill-usage.json: it reads what the
-- dashboard shows and nothing else (no key hashes, no cache salts, no Stripe ids, no writes).
-- Run it as the database owner, after `tokenmill migrate upgrade`; then give the role a
-- password with psql's \password grafana_reader (it sends a hash, never the password).
CREATE ROLE grafana_reader LOGIN;
GRANT USAGE ON SCHEMA public TO grafana_reader;
GRANT SELECT ON usage_events, usage_rollups, refusals TO grafana_reader;
GRANT SELECT (id, name) ON organizations TO grafana_reader;
GRANT SELECT (id, name, prefix) ON api_keys TO grafana_reader;
