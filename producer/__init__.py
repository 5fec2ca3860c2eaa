"""The producer: a frozen target in vLLM, teacher-forced over a chat dataset, writing the cache."""
