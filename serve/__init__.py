"""``rlfleet serve``: the fleet behind an OpenAI-compatible HTTP API (``server``: run it; ``app``: the
routes; ``front``: a request's path through the fleet; ``protocol``: OpenAI <-> fleet; ``metrics``)."""
