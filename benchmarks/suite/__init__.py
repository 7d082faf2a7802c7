"""`make bench`: the planning and training benchmarks in one run, their tables, and results.json,
the file the README's figures come from."""
