"""The engine shard: the actor around one engine backend (vLLM, or none), and its request gate."""
