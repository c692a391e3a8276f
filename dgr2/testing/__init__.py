"""Test-only helpers (fault injection); never imported by the pipeline."""
