"""ember's benchmarks: one harness (bench/harness.py), the benchmarks beside it, one-off studies in
bench/studies/. Each script runs as a file (``.venv/bin/python bench/demo.py``) and imports
``bootstrap`` first, which puts the checkout on ``sys.path``; imported as a package (``python -m
bench.demo``, or one script importing another), ``bootstrap`` is this package's."""

import sys

from bench import bootstrap

sys.modules.setdefault("bootstrap", bootstrap)
