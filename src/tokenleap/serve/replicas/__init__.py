"""Replicas of the server on Ray Serve."""
