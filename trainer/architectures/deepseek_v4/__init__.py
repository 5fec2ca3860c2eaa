"""The DeepSeek-V4 draft architecture: its layers and its (refused) serving format."""
