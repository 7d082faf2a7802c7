"""Real training under torchrun on gloo CPU ranks: throughput against torch's own parallel
trainers, learning real text, surviving lost ranks, host memory at a run's start."""
