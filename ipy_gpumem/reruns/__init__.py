"""A cell run again: what each run left alive, compared with the run before, and who keeps the earlier run's memory."""
