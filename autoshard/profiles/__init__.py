"""Network and device profiles as data: what the machines can do (presets; later calibrated files)."""
