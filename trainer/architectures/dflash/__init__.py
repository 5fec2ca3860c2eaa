"""The DFlash draft architecture: the Qwen3 backbone with the DFlash block layout."""
