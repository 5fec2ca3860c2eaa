"""The Gemma 4 draft architecture: its layers and its serving format."""
