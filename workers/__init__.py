"""The worker process around one engine: HTTP server, registration and heartbeats."""
