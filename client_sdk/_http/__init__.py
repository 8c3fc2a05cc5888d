"""The SDK's HTTP: how a request becomes an exchange with a shard."""
