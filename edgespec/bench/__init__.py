"""`edgespec bench`: side-by-side benchmarks of decoding configurations and peers.

suites.py    the shipped prompt suites (package data in suites/) and --prompts FILE
runner.py    configurations, the interleaved loop, the greedy check, summaries
peers.py     llama-cpp-python and llama.cpp's binaries as configurations
hardware.py  the machine's fingerprint, peak RSS per run
report.py    results.json (results.schema.json), results.md, PNG plots
"""
from .runner import SCHEMA, BenchOptions, run_bench

__all__ = ["SCHEMA", "BenchOptions", "run_bench"]
