"""The tools on top of the library: the command line (`cli`), `demo`, `bench` (`bench`,
`bench_moe`, `harness`), `characterize`, `accuracy`, and `report` (tables, plots, provenance).
The library never imports this package."""
