"""The data plane, in the caller's process: clients send requests straight to the shards."""
