"""The small core both halves use: one-line errors, secret redaction, atomic writes, params.yaml's schema and the
Python environment a run is pinned to."""
