"""The draft every architecture shares: config, layers, heads, rope, anchors, passes, model."""
