"""ember's benchmarks: one harness (bench/harness.py), the benchmarks beside it, one-off studies in
bench/studies/. Each script runs as a file: ``.venv/bin/python bench/demo.py``."""
