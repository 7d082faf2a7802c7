"""Command-line entry points: plan and train."""
