"""The training step as a graph: joint forward+backward trace, repeated blocks, unrolling."""
