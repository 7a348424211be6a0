"""Data: tokenizers (more to come: preparing token files and the deterministic loader)."""
