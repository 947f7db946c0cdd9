"""Front door: tokenize, KV-cache-aware routing, SLO prediction, admission, failover."""
