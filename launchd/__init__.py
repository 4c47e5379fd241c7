"""launchd (macOS) and systemd (Linux) units rendered from mlxd's config.

Not built yet (issue 5).
"""
