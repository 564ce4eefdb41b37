"""Billing: price book, usage ledger, rollups, invoices, exports, Stripe."""
