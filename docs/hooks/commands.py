"""MkDocs hook (stub, filled in by its owner)."""
