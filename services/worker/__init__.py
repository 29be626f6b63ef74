"""What prefill and decode workers share around their engine: start, registry entry, stop."""
