"""Benchmark logic (the programs in tools/ are thin wrappers). Nothing here is a test."""
