"""The cell in flight and its record: the per-cell ledger, ``%%gpumem`` (its header, its per-line markers, its phases) and their views."""
