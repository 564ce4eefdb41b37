"""Stripe sync (invoices or meters mode) and its webhooks."""
