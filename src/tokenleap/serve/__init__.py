"""Serving: the OpenAI-compatible HTTP server, its scheduler and jobs, replicas."""
