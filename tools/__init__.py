"""Programs around the store (benchmarks, the crash harness, admin wrappers): not library code,
not shipped in the wheel. ``tools.bench`` holds the benchmark logic the ``tools/bench_*.py``
programs run."""
