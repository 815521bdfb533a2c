"""Who holds the memory: every tensor byte in the user's namespace attributed to a category and a holder."""
