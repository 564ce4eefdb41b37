"""Organisations, their users and their API keys."""
