"""Exporters read watchdog state; they never drive the decode."""
