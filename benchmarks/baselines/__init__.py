"""What autoshard is compared against: torch's own parallel trainers (the FSDP+TP recipe, pure
FSDP2, DistributedDataParallel), launched by the training and cost-model benchmarks."""
