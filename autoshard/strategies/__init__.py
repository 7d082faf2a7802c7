"""Candidate layouts per graph node: DTensor's registries, our own rules, device-order variants."""
