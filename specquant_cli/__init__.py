"""specquant: quantized model families, complexity routing and lossless speculative decoding."""

__version__ = "0.1.0"
