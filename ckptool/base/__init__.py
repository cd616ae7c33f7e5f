"""Errors, exit codes, terminal-safe text, --json documents, progress: what every layer may use."""
