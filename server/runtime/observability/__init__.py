"""Observability: every metric (one module per subsystem), explain reports, the server's status."""
