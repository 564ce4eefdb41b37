"""Tokenmill's shared core: settings, database, bus, limits, hashing, wire types, tokenization."""

__version__ = "0.1.0"
