"""Side-by-side attention benchmarks; run `python -m benchmarks.bench_attention --help`."""
