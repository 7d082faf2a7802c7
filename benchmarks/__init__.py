"""autoshard's benchmarks, grouped by what they measure: planning/, cost_model/, training/,
executor/, gpu/, the plain-torch trainers they compare against in baselines/, and `make bench`'s
runner in suite/. Each runs from the repository root as `python -m benchmarks.<group>.<name>`;
benchmarks/README.md lists them."""
