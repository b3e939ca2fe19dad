"""Development tooling, not shipped (the wheel holds kernels/, runtime/ and services/): the demo
(`make demo`), the checkpoint and artifact builders of the tests, benches and demo (`builders`),
perplexity and greedy helpers (`eval`), process memory readings (`process_memory`) and the server
processes the demo, tests and benchmarks start (`processes`). It may import the product packages;
they never import it."""
