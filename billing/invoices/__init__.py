"""Monthly invoices built from the rollups."""
