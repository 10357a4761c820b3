"""Placeholder; the optimized-BLAS loader arrives with the benchmarks issue."""
