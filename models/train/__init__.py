"""Training the learned router: label (models -> shards), fit (shards -> router file), eval (routed decoding)."""
