"""Developer tools: the structure check (layers.py)."""
