"""``%gpumem free``: release what costs the user nothing (IPython's last error, cached outputs), never a variable."""
