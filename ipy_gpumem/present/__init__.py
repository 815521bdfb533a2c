"""What the user is shown: each finished cell, ``%gpumem`` mode and estimate turned into outputs in order, without IPython."""
