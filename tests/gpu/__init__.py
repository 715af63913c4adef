"""The GPU check's scripts (README.md); a package so that tests can import them."""
