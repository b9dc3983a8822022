"""Speed and memory benchmarks (run from the repository root: ``python -m benchmarks NAME``)."""
