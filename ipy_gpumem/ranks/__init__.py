"""The processes a cell launches (the ranks of a distributed launch): found, read while they run, and shown one row each."""
