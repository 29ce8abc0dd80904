"""The GPU suite's parts: one module per section, and the runner that forks them (``benchmarks/gpu_suite.py``).

common: what every section shares (Context, Section, NEEDS_CUDA); one module per section, named for what it
measures; catalog: the section table (letters, titles, budgets); environment: the report's header; runner: each
section in a forked process under its budget; report: gpu_suite.json and gpu_suite.md. Imported with benchmarks/
on ``sys.path`` (as ``python benchmarks/gpu_suite.py`` runs), beside the scripts the sections reuse.
"""
