"""autoshard: auto-parallel FSDP+TP planning for PyTorch."""
