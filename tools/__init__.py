"""Developer tools that are neither product nor tests (run from the repository root)."""
