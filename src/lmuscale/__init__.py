"""lmuscale: scaling-law experiments on Legendre Memory Unit language models."""

__version__ = "0.1.0"
