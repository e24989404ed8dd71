"""One-off studies whose answers are recorded in bench/README.md, kept because a coming issue runs
them again. Each runs as a file: ``.venv/bin/python bench/studies/X.py``."""
