"""`edgespec bench`: side-by-side benchmarks of decoding configurations and peers.

suites.py    the shipped prompt suites (package data in suites/) and --prompts FILE
runner.py    configurations, the interleaved loop, the greedy check, summaries
peers.py     llama-cpp-python and llama.cpp's binaries as configurations
hardware.py  the machine's fingerprint, peak RSS per run, read bandwidth
roofline.py  bytes read per token, the memory roofline, decode speed and batch cost per backend
reference.py the float64 forward pass of a GGUF (the yardstick of faithfulness)
faithfulness.py  KL divergence and top-1 agreement of each backend to that reference
report.py    results.json (results.schema.json), results.md, PNG plots
"""
from .runner import SCHEMA, BenchOptions, run_bench, run_roofline

__all__ = ["SCHEMA", "BenchOptions", "run_bench", "run_roofline"]
