"""The Kimi K3 draft architecture: its latent-attention layers and its serving format."""
