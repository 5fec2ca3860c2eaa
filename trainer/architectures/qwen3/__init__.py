"""The Qwen3 draft architecture: the shared draft as is, and its DSpark and DFlash formats."""
