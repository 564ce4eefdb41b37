"""Refused requests per organisation, API key, reason and minute, added up by the gateways."""
