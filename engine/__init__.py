"""Flotilla's inference engine: paged attention, continuous batching, prefix caching."""
