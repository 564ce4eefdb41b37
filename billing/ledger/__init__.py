"""The usage ledger: one row per request, from the gateways' usage events."""
