"""One shard: its store, admission, snapshots and durability, its HTTP server against the
protocol and hostile input, its limits, and its use of the web stack's internals."""
