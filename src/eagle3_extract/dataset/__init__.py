"""Chat data -> tokenized samples: rows, the chat template and loss mask, the reusable tokenized set, batches, shards."""
