"""The whole system as users run it: training across processes, the demo, the CLI, containers
and deployment files, a fleet spread over hosts, a fleet against a model, and make bench."""
