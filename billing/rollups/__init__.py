"""Hourly rollups of the ledger and the workers' lifetimes, priced."""
