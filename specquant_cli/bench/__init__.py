"""`specquant bench`: datasets, the interleaved runner, and reports."""
