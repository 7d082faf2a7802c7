"""Benchmarks for a machine with a GPU: the rates one GPU sustains on a large plan's ops, and the
GPU check (a whole step against plain torch, rank 0's program against the cost model)."""
