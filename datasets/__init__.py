"""Stride's data: prepared Parquet sets, Parquet inspection, and the deterministic sample order.

This package shares its name with Hugging Face `datasets`; tests/test_imports.py proves that
`import datasets` resolves here when Stride runs from the repo root.
"""

STRIDE_DATASETS = True
