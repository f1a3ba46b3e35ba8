"""One module per command; each body is thin and calls core code."""
