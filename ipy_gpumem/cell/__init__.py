"""The per-cell ledger: one record per cell, ``%%gpumem`` (its header, its per-line markers) and their views."""
