"""Model implementation, weight loading and quantization."""
