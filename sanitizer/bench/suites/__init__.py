"""Two pytest suites the overhead benchmark runs with and without the sanitizer (needs a GPU)."""
