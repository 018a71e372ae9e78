"""Benchmarks: each prints ratios against a ceiling measured in the same run and writes JSON."""
