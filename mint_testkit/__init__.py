"""What the tests and the benchmarks share, installed with the project so neither reaches into the other's folders:
servers started as a test or a benchmark starts them (`harness`), adapters corrupted one way each
(`bad_adapters`), waits with a deadline (`waiting`) and the one rule for a missing service (`skips`). The library
and the application never import it (a contract in pyproject.toml)."""
