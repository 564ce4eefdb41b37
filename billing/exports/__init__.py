"""Exports of usage, rollups and invoices as CSV or JSON."""
