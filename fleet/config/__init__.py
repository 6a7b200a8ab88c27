"""Typed configuration: an engine shard's, the admission law's, a whole fleet's."""
